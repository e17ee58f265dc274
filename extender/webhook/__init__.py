"""The admission webhook: admission (the pure decision), certs (a self-signed CA and serving
certificate), bootstrap (the shared Secret and the caBundle), server (the HTTPS listener)."""
