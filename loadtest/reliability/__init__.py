"""The leak probe (`leak_probe`: what a cluster still holds after its requests ended),
and the soak (`soak`) that ends with it."""
