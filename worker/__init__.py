"""GPU workers: RQ entry point, job runner driving peagle_core, artifact store, reconciler."""
