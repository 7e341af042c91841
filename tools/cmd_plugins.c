/* cmd_plugins: written next. */
