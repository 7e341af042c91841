/* comm: written next. */
