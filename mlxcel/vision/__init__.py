"""Images in chat requests: reading and checking them, preparing them for a vision model, encoding them.

`images` (pure: no Trio, no MLX) reads an image part's bytes and decodes
them; `processing` turns a decoded image into pixel values and the run of
placeholder tokens it takes in the prompt; `encoder` (the device thread only)
runs the vision tower through mlx-vlm. The random-weight vision models of
the tests are written by `mlxcel.fixtures.vision`.
"""
