/* log: written next. */
