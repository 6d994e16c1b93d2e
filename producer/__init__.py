"""specfleet producer: enqueues datasets in order, watches their budgets, collects the rows."""
