"""What the producer and the workers share: settings, run config, task contract, Redis keys, budget."""
