"""Continual distillation from served traffic: the ledger of logged requests (`ledger`), one update (`update`), and
the job that trains, checks and publishes (`job`)."""
