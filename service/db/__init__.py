"""Database layer: schema (models), engines/sessions (session) and the job status machine (jobstate)."""
