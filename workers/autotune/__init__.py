"""Autotuning: the candidate space of a target and the rule that picks a winner (`space`), Inductor's
kernel choices shared across the farm (`share`), and static specializations at hot sizes
(`specialize`)."""
