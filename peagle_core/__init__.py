"""P-EAGLE drafter training library: model, COD sampling, data, hidden states, trainer, evaluation, export."""
