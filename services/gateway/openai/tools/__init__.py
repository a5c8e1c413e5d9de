"""Tool calling on the OpenAI chat API: the tools a request offers (`request`), into the
prompt and a forced call's schema (`prompt`), and calls out of the answer (`calls`)."""
