"""Units without processes or a model: the scheduler driven by fabricated tokens and clocks, the block pool checked
after every step, parsers, matchers, configuration and the tools' arithmetic."""
