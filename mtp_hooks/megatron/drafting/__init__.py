"""The drafting wing: what a forward that runs MTP tells about the drafter, and what it trains
the drafter toward, beside the gate that decides whether MTP runs.

One per-call observer interface serves the wing: :class:`._projections.Listener`. megatron
projects each MTP depth's hidden states and then the policy's through one output layer;
:class:`._projections.Projections` tells those projections apart in one forward hook and hands
each to the listeners of the calling thread. ``+metrics``' recorder (:mod:`._recorder`, with
the figures of one forward in :mod:`._depth_figures`, the engine's greedy walk over them in
:mod:`._engine_walk` and the engine's own single-position drafts in :mod:`._single_position`)
and ``+objective``'s objectives (:mod:`._objectives`) are such listeners; softmaxes and sums
over a vocabulary split across tensor-parallel ranks are in :mod:`._vocab_parallel`.

What the recorder measures leaves the wing as :class:`mtp_hooks.MTPMetrics`, through the
``mtp_metrics`` hook: that is how :class:`mtp_hooks.framework.AcceptanceController` and any
other plugin observe the drafter, per call, without torch. What a megatron-core can do here is
probed in :mod:`mtp_hooks.megatron._capabilities`, the adapters' one room for probes.

Nothing here is public. The recorder and the objectives are per-call extensions
(:mod:`mtp_hooks.megatron._call_extensions`): a phase's plan lists them, the gate begins and
ends them around each call without knowing either, and the handle reads the recorders.
"""
