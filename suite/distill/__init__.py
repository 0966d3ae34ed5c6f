"""`suite distill`: knowledge distillation from a frozen teacher into the student the recipe describes."""
