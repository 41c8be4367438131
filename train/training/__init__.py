"""Training: the training loop (`trainer.train`), its resumable state (`state`), and the acceptance
predictors' stage (`predictors`)."""
