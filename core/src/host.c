/* host: written next. */
