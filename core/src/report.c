/* report: written next. */
