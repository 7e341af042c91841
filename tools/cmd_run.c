/* cmd_run: written next. */
