"""Running over many devices and processes: the logical-axes-to-mesh table and meshes."""
