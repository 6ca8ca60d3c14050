"""The checkpoint's own MTP layer as the drafter (DeepSeek-V4).

After every target step the drafter catches the MTP layer up on the positions that step settled (a
prefill's prompt, a decode's token, a verify step's accepted prefix), each paired with the token that
followed it, then drafts k tokens autoregressively from the last one. The MTP block's sliding-window ring
sits in the state pool, indexed by position, with sliding_window + k + 1 rows: the rows its drafts wrote
beyond the settled positions are overwritten by the next catch-up before anything reads them, so a
rejected draft needs no rollback here either.

A draft is the MTP's argmax (a point mass, which verification assumes). Its confidence is its probability
under softmax(logits / T_j), T_j per draft position: 1, or with calibrate=True fitted to the measured
acceptance (sequential temperature scaling: position j is fitted on the drafts verified right after an
accepted draft j-1, by likelihood over a grid of temperatures). The fit keeps only the top CALIB_TOP_K
logits of each draft, so its confidences slightly overestimate on very flat distributions."""
from collections import deque

import torch

from deepinfer import _C
from deepinfer.layers.attention_metadata import AttentionMetadata

CALIB_TOP_K = 32
CALIB_SAMPLES = 4096  # per draft position, most recent
CALIB_EVERY = 256  # new samples between refits
CALIB_GRID = torch.logspace(-1, 1, 41)  # temperatures 0.1 .. 10


class MTPDrafter:
    def __init__(self, k: int, model, calibrate: bool = False):
        if len(model.mtp) != 1:
            raise ValueError(f"LLM(speculative={{'method': 'mtp'}}): drafting with {len(model.mtp)} MTP layers is "
                             "not supported (DeepSeek-V4 checkpoints carry one)")
        if not model.mtp_enabled:
            raise ValueError("the MTP drafter needs the model's MTP rings in the state pool (mtp_enabled before "
                             "cache_spec)")
        self.k, self.model, self.calibrate = k, model, calibrate
        model.capture_streams = True
        self.temperature = torch.ones(k)
        self.drafts: dict[int, tuple] = {}  # seq id -> (tokens [k], confidences [k], top-logit gaps [k, K] if calibrating)
        self.samples = [deque(maxlen=CALIB_SAMPLES) for _ in range(k)]
        self.fresh = 0

    def propose(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts made after the previous step; a sequence without any (just imported) drafts nothing."""
        tokens = torch.zeros(len(batch.seq_ids), self.k, dtype=torch.int64)
        conf = torch.zeros(len(batch.seq_ids), self.k, dtype=torch.float64)
        for row, seq_id in enumerate(batch.seq_ids):
            if seq_id in self.drafts:
                tokens[row], conf[row], _ = self.drafts[seq_id]
        return tokens, conf

    # ---- after a target step: catch up, then draft -------------------------------------------------------

    @torch.inference_mode()
    def after_step(self, engine, batch, results) -> None:
        settled = self._settled(batch, results, engine.scheduler)
        stepped = set(batch.seq_ids)
        self.drafts = {s: d for s, d in self.drafts.items() if s not in stepped}
        if not settled:
            return
        index, seq_ids, first_rows, counts, next_ids = zip(*settled)
        meta = self._catch_up_meta(batch, index, first_rows, counts, engine.config.block_size)
        rows = torch.cat([torch.arange(r, r + n) for r, n in zip(first_rows, counts)])
        out = self.model.mtp_forward(0, self.model.last_streams[rows],
                                     torch.tensor([t for ids in next_ids for t in ids]), meta)
        self._draft(list(seq_ids), out[meta.query_start_loc[1:] - 1], meta)

    @staticmethod
    def _settled(batch, results, scheduler) -> list:
        """Per sequence that goes on: (its index in the batch, seq id, first row and number of its rows the
        step settled, the token after each of those rows). A prefill chunk short of the prompt's end settles
        its rows too (the MTP ring must hold every position); the token after its last row is the prompt's next."""
        qsl, ids = batch.query_start_loc.tolist(), batch.input_ids.tolist()
        prefill = batch.type == _C.StepType.PREFILL
        out = []
        for i, (res, drawn) in enumerate(zip(results, batch.sampled)):
            if res.finished or res.reason == _C.FinishReason.HANDOFF or (drawn and (not res.tokens or res.tokens[-1] < 0)):
                continue
            lo = qsl[i]
            n = qsl[i + 1] - lo if prefill else len(res.tokens)  # verify: last real token + accepted drafts
            after = res.tokens[-1] if drawn else scheduler.sequence(res.seq_id).token_ids[int(batch.context_lens[i])]
            out.append((i, res.seq_id, lo, n, ids[lo + 1:lo + n] + [after]))
        return out

    @staticmethod
    def _catch_up_meta(batch, index, first_rows, counts, block_size) -> AttentionMetadata:
        """Prefill-type metadata over the settled rows (positions continue each sequence's MTP ring)."""
        seqs = torch.tensor(index)
        positions = torch.from_numpy(batch.positions)
        pos = torch.cat([positions[r:r + n] for r, n in zip(first_rows, counts)])
        qsl = torch.tensor([0] + list(counts)).cumsum(0)
        ctx = pos[qsl[1:] - 1] + 1
        return AttentionMetadata(
            is_prefill=True, positions=pos, slot_mapping=torch.zeros_like(pos), query_start_loc=qsl,
            context_lens=ctx, block_tables=torch.from_numpy(batch.block_tables).long()[seqs],
            state_slots=torch.from_numpy(batch.state_slots).long()[seqs], block_size=block_size,
            max_query_len=max(counts), max_context_len=int(ctx.max()))

    def _draft(self, seq_ids: list[int], streams: torch.Tensor, meta: AttentionMetadata) -> None:
        """streams [R, N, H]: the MTP output at each sequence's last settled position p. Draft j (0-based)
        comes from the MTP row at position p + j and predicts the token at p + j + 2."""
        R = len(seq_ids)
        last = meta.context_lens - 1
        tokens = torch.zeros(R, self.k, dtype=torch.int64)
        conf = torch.zeros(R, self.k, dtype=torch.float64)
        gaps = torch.zeros(R, self.k, CALIB_TOP_K) if self.calibrate else torch.zeros(R, 0)
        for j in range(self.k):
            logits = self.model.mtp_logits(0, streams)
            tokens[:, j] = logits.argmax(-1)
            conf[:, j] = torch.softmax(logits / self.temperature[j], dim=-1).max(-1).values.double()
            if self.calibrate:
                gaps[:, j] = top_logit_gaps(logits)
            if j + 1 < self.k:
                step = _decode_meta(last + j + 1, meta)
                streams = self.model.mtp_forward(0, streams, tokens[:, j], step)
        for r, seq_id in enumerate(seq_ids):
            self.drafts[seq_id] = (tokens[r], conf[r], gaps[r])

    # ---- calibration ---------------------------------------------------------------------------------------

    def observe(self, seq_ids, verified, accepted) -> None:
        """Per sequence: drafts verified and accepted this step (in the order they were proposed)."""
        if not self.calibrate:
            return
        for seq_id, v, a in zip(seq_ids, verified, accepted):
            if seq_id not in self.drafts:
                continue
            gaps = self.drafts[seq_id][2]
            for j in range(min(v, a + 1)):  # draft j counts only if draft j-1 was accepted
                self.samples[j].append((gaps[j], j < a))
                self.fresh += 1
        if self.fresh >= CALIB_EVERY:
            self.fresh = 0
            self.temperature = torch.stack([fit_temperature(s) for s in self.samples])


def top_logit_gaps(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> [R, CALIB_TOP_K]: max logit minus each of the top ones (inf past V), what the
    temperature fit needs of a draft's distribution."""
    top = logits.topk(min(CALIB_TOP_K, logits.shape[-1]), dim=-1).values
    gaps = torch.full((logits.shape[0], CALIB_TOP_K), float("inf"))
    gaps[:, :top.shape[1]] = top[:, :1] - top
    return gaps


def fit_temperature(samples) -> torch.Tensor:
    """samples: (top-logit gaps [K], accepted) pairs -> the grid temperature of highest likelihood (1.0
    without samples). Confidence at T = 1 / sum_i exp(-gap_i / T)."""
    if not samples:
        return torch.tensor(1.0)
    gaps = torch.stack([g for g, _ in samples])  # [S, K]
    y = torch.tensor([float(a) for _, a in samples])
    conf = 1 / torch.exp(-gaps[None] / CALIB_GRID[:, None, None]).sum(-1)  # [G, S]
    conf = conf.clamp(1e-6, 1 - 1e-6)
    nll = -(y * conf.log() + (1 - y) * (1 - conf).log()).sum(-1)
    return CALIB_GRID[nll.argmin()]


def _decode_meta(positions: torch.Tensor, like: AttentionMetadata) -> AttentionMetadata:
    """One row per sequence at `positions` [R], same sequences (slots, tables) as `like`."""
    R = positions.shape[0]
    return AttentionMetadata(
        is_prefill=False, positions=positions, slot_mapping=torch.zeros_like(positions),
        query_start_loc=torch.arange(R + 1), context_lens=positions + 1, block_tables=like.block_tables,
        state_slots=like.state_slots, block_size=like.block_size, max_query_len=1,
        max_context_len=int(positions.max()) + 1)
