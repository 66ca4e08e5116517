"""Configuration: strict YAML loading (`strict`), topology files (`topology`), the relay-tree planner (`plan`)."""
