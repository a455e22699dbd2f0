"""The presets: each a mesh and its layout policies, independent of one another."""
