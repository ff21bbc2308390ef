"""qae_app/algo: the advantage estimators, the policy loss, the chunked log-probs through the LM head. The
fixtures are tests/conftest.py's."""
