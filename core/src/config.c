/* config: written next. */
