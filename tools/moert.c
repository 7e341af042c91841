/* moert: written next. */
