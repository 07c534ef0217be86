"""A GRPO loss normalisation: L = 1/|M| sum_i sum_t l_{i,t} (each sequence's summed loss, averaged over sequences)."""
from rl_loop import register_loss_norm


@register_loss_norm("seq-sum")  # --loss_norm=seq-sum, once registered before the config is parsed
def seq_sum(l, mask, cu_seqlens, *, n_seqs, n_tokens, max_len, n_micro):
    # l: this micro-batch's per-token losses (T,), zero off mask; n_seqs / n_tokens count the whole minibatch.
    # Linear in l, so dist_step's per-token weights w_t = dL/dl_t carry it to any DP x PP x CP layout unchanged.
    return l.sum() / max(n_seqs, 1)
