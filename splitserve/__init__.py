"""SplitServe: distributed LLM serving."""
