/* tensor_ops: written next. */
