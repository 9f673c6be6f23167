"""titan-plan: ranking, explanation and (later) measured trials. Never imports torch."""
