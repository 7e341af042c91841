/* task: written next. */
