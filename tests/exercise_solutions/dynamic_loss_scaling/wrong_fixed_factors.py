"""The scale doubles and halves whatever growth_factor and backoff_factor the scaler was given."""
import numpy as np


class DynamicLossScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.clean = 0

    def unscale_(self, grads):
        for g in grads:
            g /= self.scale
        return any(not np.isfinite(g).all() for g in grads)

    def update(self, found_inf):
        if found_inf:
            self.scale *= 0.5
            self.clean = 0
        else:
            self.clean += 1
            if self.clean == self.growth_interval:
                self.scale *= 2.0
                self.clean = 0


EXPECT = ['growth_factor=4', 'backoff_factor=0.25', 'after step', 'expected']
