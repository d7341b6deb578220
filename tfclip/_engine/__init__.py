"""tfclip's engine: the machinery every front door (tfclip.fused_clip_apply with tfclip.rules, the
Keras 3, tf_keras and TF1 optimizers) drives, and no user imports. Its modules, from the bottom up:

- `opcall`: the rule table as Python sees it and the one raw op call (`apply`), with the clip
  and policy checks;
- `binding`, `keras_bindings`: a stock class's binding to a rule-table row, as data, and the rows
  both Keras libraries share; `checks`: the argument checks against the core's tables;
- `narrow_state`: `state_dtype`'s slots (bfloat16, int8); `loss_scale`: a loss scale's unscale
  folded into a step; `tf_clip`: the op's clip in TF ops, for gradients no op takes; `xla`: the
  XLA questions the drop-ins ask;
- `step`: THE fused step (`run`): the clip, the norm pass, one apply op per group of variables;
- `collectives`: TF's raw collectives across worker processes on CPUs, in pieces (the
  reduce-scatter, the all-gather, and the unsharded step's all-reduce built from the two);
- `shard`: shard_state (each replica's share of the state; across worker processes the
  gradients' reduce-scatter, with the norms from exchanged partials; the all-gather after the
  step); `reduce`: reduce_dtype (the gradients cast to 16 bits before they cross replicas);
- `replicated`: `tfclip.fused_clip_apply` under tf.distribute (every copy alike, or sharded);
- `dropin`: what the Keras 3 and tf_keras drop-ins share (their fused step, tfclip's own state);
  `mixup`: a drop-in handed to the other Keras library names the class to use.

Imports run down this list (tests/test_build_layers.py); the engine imports no front door.
"""
