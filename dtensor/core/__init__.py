"""The core values and array operations: meshes, layouts, laid-out arrays, rules, collectives."""
