/* error: written next. */
