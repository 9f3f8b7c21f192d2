"""What the examples and tests train: builtin models made locally, rule rewards, reward-model training.\n\nNot
library code of the pipeline: the pipeline names these only by configuration (``builtin:<name>``,
``recipes.rewards:<function>``)."""
