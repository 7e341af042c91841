/* executor: written next. */
