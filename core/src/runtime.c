/* runtime: written next. */
