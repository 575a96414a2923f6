"""Input and output processing (vLLM v1's engine processors): a request validated into its
parameters on the caller's thread, tokens turned into text and stops, and the streams text reaches
its reader through. Standard library and numpy only: the front end imports `streams`."""
