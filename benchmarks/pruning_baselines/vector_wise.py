"""Vector-wise 2:4 pruning the way APEX's ASP does it: walk the module tree
for supported layers, compute m4n2_1d masks, prune the weights in place and
patch ``optimizer.step`` to re-apply the masks after every step."""

import itertools
import types

import torch

PATTERNS = torch.tensor([[1.0 if i in keep else 0.0 for i in range(4)]
                         for keep in itertools.combinations(range(4), 2)])
WHITELIST = (torch.nn.Linear, torch.nn.Conv2d)


def m4n2_1d(weight):
    """ASP's mask: best 2 of every 4 consecutive input channels."""
    if weight.dim() == 4:   # (out, in, kh, kw) -> rows of input channels
        matrix = weight.permute(2, 3, 0, 1).reshape(-1, weight.shape[1])
    else:
        matrix = weight
    groups = matrix.detach().abs().reshape(-1, 4).double()
    mask = PATTERNS.double()[(groups @ PATTERNS.double().T).argmax(dim=1)].reshape(matrix.shape)
    if weight.dim() == 4:
        kh, kw = weight.shape[2:]
        mask = mask.reshape(kh, kw, weight.shape[0], weight.shape[1]).permute(2, 3, 0, 1)
    return mask.to(weight.dtype).contiguous()


class ASP:
    """``ASP(model, optimizer).prune()``: ASP's ``prune_trained_model``."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.masks = model, optimizer, {}

    def prune(self):
        for name, module in self.model.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, WHITELIST) or weight is None:
                continue
            if weight.shape[0] % 8 or weight.shape[1] % 16:
                continue
            self.masks[name] = (weight, m4n2_1d(weight))
        self._apply()
        step = self.optimizer.step

        def masked_step(optimizer, *args, **kwargs):
            result = step(*args, **kwargs)
            self._apply()
            return result

        self.optimizer.step = types.MethodType(masked_step, self.optimizer)
        return self

    @torch.no_grad()
    def _apply(self):
        for weight, mask in self.masks.values():
            weight.mul_(mask)
