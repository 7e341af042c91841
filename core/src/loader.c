/* loader: written next. */
