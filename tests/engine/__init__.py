"""The real model in process: the scheduler and the model runner without sockets, checked token for token against
transformers."""
