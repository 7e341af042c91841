/* cmd_check: written next. */
