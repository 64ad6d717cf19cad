"""The plain SGD loop the tensor-parallel scenarios run on a model and its serial twin."""


def sgd(model, steps, batch, *, lr, tp=None, dp=None):
    """``steps`` plain SGD steps on ``batch(step) -> (x, y)``; returns the losses.

    ``tp``: sum the replicated parameters' partial gradients over it (sequence parallelism);
    ``dp`` (a DataParallel): this rank's part of each global batch, gradients reduced by it.
    """
    from hpcnn.nn.layers import place_draws
    from hpcnn.parallel.tensor.linear import sync_replicated_grads
    losses = []
    for s in range(steps):
        x, y = batch(s)
        h, k = (x.shape[0] // dp.comm.size, dp.comm.rank) if dp is not None else (0, 0)
        if dp is not None:
            x, y = x[k * h:(k + 1) * h], y[k * h:(k + 1) * h]
        place_draws(model, s, k * h)                  # the serial step's masks for these rows
        model.zero_grad()
        loss, caches = model.forward(x, y)
        if dp is None:
            model.backward(1.0, caches, need_dx=False)
        else:
            dp.backward(1.0 / dp.comm.size, caches)
            dp.finish(s)
        if tp is not None:
            sync_replicated_grads(model.params, tp)
        for p in model.params:
            p.data -= lr * p.grad
        losses.append(loss)
    return losses
