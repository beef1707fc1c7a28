"""Memory, measured: ``accounting`` counts the bytes of live tensors; ``check`` runs a few training steps and
sets those measurements beside what ``minituner.planner`` predicts (the planner is arithmetic and never
builds a model)."""
