/*
 * decode_step - GPT-2's whole decode step, every layer and the argmax, for `steps` tokens in one
 * persistent kernel: one block per SM, each block's share of the weights streamed into shared memory
 * ahead of its use, and between stages a handoff of data that carries its own step: one grid barrier
 * per token, after the argmax.
 *
 * The operation: `steps` greedy steps of gpt2/model.py with the KV cache, from state = {token, pos}:
 *   x = wte[token] + wpe[pos]
 *   per layer:  A  qkv = LN_1(x) W_attn + b;  k, v stored into the cache at pos            -> handoff
 *               B  attention of q over the cache rows 0..pos, split over the keys; the splits of a
 *                  head hand each other their partials, each combines them into y_h and computes
 *                  its rows of the head's term of attn.c_proj: proj_h = y_h W_proj[h]     -> handoff
 *               C  x += sum_h proj_h + b;  g = gelu(LN_2(x) W_fc + b)                     -> handoff
 *               D  x += g W_mlp + b                                                       -> handoff
 *   E  token = argmax(LN_f(x) wte^T);  history[pos + 1] = token;  state = {token, pos + 1} -> barrier
 * The same operations as the per-operation step (gemv.cu, decode_attention.cu, lm_head_argmax.cu),
 * fused into one launch that loops over the stages.
 *
 * Why: at batch 1 the step reads every weight once (0.25 GB in bfloat16, under 100 us at an H100's
 * bandwidth), but as 62 dependent kernels it pays a kernel boundary each time, and the per-operation
 * step spends most of its time between kernels (lab.py --profile-step). Here a boundary costs a round
 * trip through L2, and the weights no longer wait for it: a stage's weights do not depend on the
 * activations, so each block copies its share of the next stages' weights into a ring of shared-memory
 * slots (cp.async.bulk, completion on an mbarrier per slot) while it computes and while it waits.
 *
 * Handoffs (the LL protocol of NCCL's low-latency kernels). A value one block hands to others is an
 * 8-byte word: the float, and the step's epoch in the high half, stored and loaded as one access
 * (single-copy atomic). A reader loads the words it needs, all at once, and loads again those that
 * still carry an older epoch; when all carry this step's, it has the values. No fence, no barrier,
 * and a reader waits only for the blocks whose values it reads: stage B's split for the few that own
 * its head's q, k and v rows, and for the other splits of its head. Every buffer is per layer, so a
 * word is rewritten only in the next step, after the step's last barrier (ordered: every read of it
 * is done). Epochs count steps across launches (ll_epoch): no two steps within 2^32 share one.
 * Where every block reads what every block wrote (x after stage D, g, and the 12 * C heads' terms of
 * attn.c_proj that stage C sums), the bytes are the cost, and those go as parity words: 4 bytes, the
 * float with the step's parity in its lowest mantissa bit (pw_store), enough because every word of
 * those buffers is written in every step. As 8-byte words the heads' terms were slower than a grid
 * barrier and a plain read through L2; as parity words they are a little faster than that (H200,
 * bfloat16: 182 against 185 us a token at position 264, 185 against 186 at 519), and they leave the
 * argmax's barrier the only one. Adding the heads' terms up in L2 did not help: as fixed-point
 * integers that also count their terms (red.add, deterministic in any order; C polls the C sums
 * until each counts NH terms, no barrier) the step was no faster (189 against 188 us a token);
 * mlp.c_proj's output summed that way over all the blocks' rows of g (132 terms a word, in place of
 * stage D's handoff of g) was slower, 204 against 193: same-address atomics queue.
 *
 * LayerNorm folded into the rows that follow it (stages A and C). With mean m, r = 1 / sqrt(var + eps),
 * LayerNorm weight w and bias beta, row n of the linear layer (weights W_n, bias b_n) gives
 *     LN(x) . W_n + b_n = r (sum_k W_nk w_k x_k - m B_n) + c_n,   B_n = sum_k W_nk w_k,
 *                                                                 c_n = b_n + sum_k W_nk beta_k,
 * and B_n, c_n depend on the weights alone: gpt2/fast/weights.py computes them once (in float64, kept as a
 * float32 pair, the row's "fold"), and they come with the row in place of its bias. So the dot
 * products need not wait for the statistics: the input gather writes w * x beside x, the last warp
 * computes m and r (two passes, layernorm_stats) while the others take the dot products, and each
 * row's thread puts them together. Normalizing x first, then the dot products, cost a pass over x
 * and a block sync more, and the statistics themselves in every warp: folded, the step went from
 * 160.8 to 150.5 us a token in bfloat16 and from 220 to 207 in float32 (H200, position 264, same run).
 * In exact arithmetic the same; in floating point the difference a - m B_n cancels where |m| is
 * large against the spread of x, and the row loses about log2(|m| / std) bits to it. (Before the fold,
 * statistics from each thread's own values combined across warps (Chan's formula, one block sync)
 * in place of every warp's two passes made the step 12 us slower.)
 *
 * attn.c_proj inside the attention stage: y W_proj = sum_h y_h W_proj[h], with W_proj[h] the HS
 * columns (inputs) of head h, so the head's key splits can finish the projection of their own head
 * as soon as they have y_h. Each split combines all the head's splits itself, in split order. W_proj
 * comes head-major, (NH, C, HS) (gpt2/fast/engine.py makes the copy), so that a split's rows of its head's
 * columns are one contiguous range, streamed with its keys. Stage C sums the heads' terms in head
 * order, the same in every block, so the step stays deterministic. Summing them at the end of stage
 * B instead, each block its share of x's columns, handed to stage C as 768 parity words in place of
 * 12 * 768, was slower (H200: bfloat16 151 against 146 us a token, float32 223 against 206): two
 * handoffs cost more than one that reads twelve times the bytes. At gpt2-xl it goes the other way
 * (REDUCE_HEADS, gpt2/fast/plan.py's step_reduce_heads): its 25 heads' terms of 400 columns take a
 * thread with two columns 6 round trips through L2 one after another (proj_input keeps 10 heads' loads
 * in flight), where reduce_heads has each block sum its 4 columns (100 words at once), hand them on,
 * and stage C gather x as it gathers x after stage D. H200, `tools/step_variants.py`, us a token at
 * 264, same run (without / with): gpt2-xl float32 2,213.8 / 2,174.8, bfloat16 1,533.3 / 1,522.5;
 * where proj_input takes 2 round trips the extra handoff costs more than it saves: gpt2-large float32
 * 1,169.2 / 1,201.2, bfloat16 809.7 / 851.1, gpt2-medium float32 583.7 / 612.4, bfloat16 394.9 / 393.7.
 *
 * The weight stream. Block b of G owns a fixed share of every stage: rows [b * ceil(N / G), ...) of
 * each (out, in) matrix, one contiguous range of bytes, plus the vectors the stage reads (LayerNorm's
 * weight and the rows' folds, or the rows' biases), so that everything a stage reads that is not an activation
 * lands with it; in stage B it owns one (head, key split) or, past NH * splits, nothing (gpt2/fast/plan.py
 * picks fewer splits than one a block: a head's splits wait for each other), and its item is that
 * split's cached K and V rows below pos and its rows of the head's W_proj[h] (the row at pos comes
 * from stage A's handoff); in stage E its rows of wte past the first lm_keep, in chunks of `lm_rows`
 * rows with their folds (below); a share larger than the slot comes as several items (below).
 * Item i of the stream lands in slot i % nslot. A producer warp of its own issues the
 * copies: item i once the compute warps are done with item i - nslot (an "empty" mbarrier per slot,
 * on which every compute thread arrives: see release below)
 * and ISSUE_DELAY_NS more have passed (see "When to copy" below), so up to nslot items are in flight
 * or waiting, across stages and steps, and a copy that is slow to issue stalls only the producer; the
 * compute warps sync on a named barrier of their own (compute_sync). Every block consumes the same
 * number of items per step (an item may be empty: the mbarrier's phase then completes on the arrive).
 * The cache rows were written by earlier steps with ordinary stores: a step's stage B items wait until
 * the compute warps have passed the previous step's last barrier (the `stepped` mbarrier), and the
 * copy is fenced into the async proxy. Stage E reads wte at about the copy ceiling already: prefetching
 * its first chunks into L2 during the last layer or two (cp.async.bulk.prefetch.L2, 3 to 10 chunks a
 * block) made the step 0-4% slower.
 * Items that split a share. From gpt2-medium in float32 and gpt2-large in bfloat16 up, a block's share
 * of a stage does not fit twice in shared memory (gpt2-xl, bfloat16: mlp.c_fc's 49 rows of 1600 are
 * 157 KB, stage B's item 93 KB, of 227 KB), and the ring needs two slots. So a stage's share comes as
 * items: stage s of a layer as items[s] items of at most rows[s] rows (the plan's item_rows; every
 * count the same in every block, from count_items). A linear stage's rows are independent dot
 * products, taken a group at a time (linear_items): each item carries its rows' folds or biases, and
 * item 0 of a LayerNorm stage carries LayerNorm's weight first, at the slot's start, so that the
 * input is scaled before the rows are needed and the rows' place does not stay in registers through
 * the input's handoff. Stage B's item is a split's sequence of rows of HS weights, its staged keys,
 * their values, its rows of W_proj[h], cut every rows[1] rows (ItemRows, in order: the scores over the
 * key rows, the softmax once they are all in, o over the value rows, the projection over W_proj[h]'s
 * rows; an item goes back as the next is taken). A block whose share runs out takes empty items, so
 * that producer and compute warps count the same items per step; the parities follow the item
 * counter as before, and every stage B item of a step waits for `stepped`. gpt2/fast/plan.py keeps one
 * item a stage where the shares fit two slots (GPT-2 small, and gpt2-medium in bfloat16: the plans
 * as before), else sizes the items for STEP_RING slots (3), else 2. With one item a stage the
 * arithmetic and its order are as before; what changed for GPT-2 small is the loops around the item,
 * LayerNorm's weight ahead of the rows, and its registers as compiled for sm_90 (float32 146 to 151,
 * bfloat16 139 to 148; one block of 352 threads an SM either way). The ring's depth at gpt2-xl, whose
 * shares are split (H200, `tools/step_variants.py --ring`, us a token at 264, REDUCE_HEADS on, one
 * device session): float32 2, 3, 4 slots 2,267.9 / 2,174.8 / 2,679.3, bfloat16 1,531.2 / 1,522.5 /
 * 1,603.7, so STEP_RING stays 3; four slots' smaller items cost more boundaries (a release, a take and
 * rows_dot's two syncs each) than their deeper ring buys.
 * When to copy. A slot comes free at the end of a stage, in every block at about the same time, and
 * that is when the blocks hand each other the stage's outputs; copies issued at once, a whole grid's
 * burst of loads that miss L2, delayed the handoffs: without any copies (the arithmetic on stale
 * slots, a diagnostic) a token took 153 us instead of 182 (H200, bfloat16, position 264). The
 * producer now waits ISSUE_DELAY_NS after a slot comes free. Measured (same run, us a token at 264,
 * 0 / 300 / 400 / 500 / 650 ns): bfloat16 181 / 170 / 169 / 170 / 174, float32 236 / 229 / 225 /
 * 223 / 223. Not better: issuing once the next stage has its inputs (bfloat16 178), or cutting each
 * item into pieces of 4, 8 or 16 KB spaced 100-300 ns apart (182, 177, 175; with the 400 ns wait, 191).
 * A wait per stage (150 ns after stage C, 700 after D, 400 elsewhere) was 2 us slower in bfloat16 and
 * 5 faster in float32. With LayerNorm folded (below) the best wait moved apart by dtype: bfloat16
 * 250 ns (145.5 us a token against 148.4 with 400 and 151.1 with 550; 150 and 200 alike with 250),
 * float32 550 ns (205.4 against 207.7 with 400 and 209.6 with 250; 700 alike), hence one per dtype
 * (bfloat16 again later, same run: 150 / 250 / 350 ns 144.4 / 144.1 / 145.5; and no wait before
 * stage E's chunks, which follow no handoff, no faster). Copying the layers' weights with an
 * evict-first L2 policy changed nothing, and prefetching wte's chunks into L2 over the last 3 or 6
 * layers (evict-last) made the step 4-5% slower (H100). Stage B's item in two (the keys and values;
 * the rows of W_proj[h], released once o is done) made the slot 44 KB in place of 60 and left room
 * for 49 kept rows of wte in place of 18, and the step slower: 152.8 against 148.5 us a token
 * (bfloat16, H200, position 264, same run; 154.3 with 18 rows kept). Keeping the memory busy through
 * the latency-bound stage B by asking L2 for the stream's items ahead of the ring (the producer, as it
 * copies item i, prefetching item i + k with cp.async.bulk.prefetch.L2) was slower at every size and
 * depth tried (H200, `tools/step_variants.py`, us a token at 264): gpt2-xl bfloat16 k = 0 / 2 / 3 / 5
 * 1,536 / 1,591 / 1,618 / 1,684; gpt2-xl float32 k = 3 2,215 against 2,385; gpt2-large bfloat16
 * 818 against 843; GPT-2 small k = 0 / 2 / 4 bfloat16 155 / 160 / 163, float32 205 / 220 / 254.
 * Nor only while stage B runs (the producer, as it copies a layer's first stage C item, asking L2 for
 * the next k items: the rest of stages C and D, whose loads would otherwise wait for ring slots), where
 * the memory has least to do: slower again, and more so the more it asks, stage B's own work growing
 * under the prefetches' traffic (H200, `tools/step_variants.py`, us a token at 64 / 264 / 600, same
 * run, 2026-12-01): gpt2-xl bfloat16 k = 0 / 3 / 6 / 10 1,478 / 1,567 / 1,606 / 1,668, 1,495 / 1,583 /
 * 1,613 / 1,670, 1,508 / 1,601 / 1,629 / 1,674 (stage B 314 / 420 / 486 / 508 us of work a token);
 * gpt2-large bfloat16 k = 0 / 3 / 6 at 264 806 / 880 / 909; gpt2-xl float32 k = 0 / 6 / 13 at 264
 * 2,105 / 2,219 / 2,386; GPT-2 small bfloat16 k = 0 / 1 / 3 at 264 153.5 / 162.5 / 166.5.
 * Where a stage's share comes as several items, most slots come free in the middle of a stage, with no
 * handoff to keep clear of, and stage B's and E's last items can be empty (no copy): the pause there
 * too is DELAY_MID_STAGE and DELAY_EMPTY, both on. Off, by size (H200, `tools/step_variants.py`, us a
 * token at 264, same run; as is / mid-stage off / empty off / both off): GPT-2 small float32 203.9 /
 * 210.5 / 209.7 / 216.9, bfloat16 152.7 / 155.0 / 154.9 / 159.2; gpt2-medium float32 583.2 / 587.0 /
 * 588.8 / 592.8, bfloat16 387.4 / 382.8 / 387.8 / 380.6; gpt2-large float32 1,173.5 / 1,180.2 / 1,139.1
 * / 1,173.5, bfloat16 814.8 / 808.7 / 830.2 / 809.6; gpt2-xl float32 2,174.3 / 2,144.4 / 2,198.6 /
 * 2,121.4, bfloat16 1,511.5 / 1,497.0 / 1,543.3 / 1,511.8 (with both off, ISSUE_DELAY_NS 0 / 150 / 400 /
 * 800: float32 2,182.9 / 2,171.9 / 2,140.2 / 2,106.2, bfloat16 1,503.9 / 1,511.4 / 1,502.8 / 1,530.2).
 * No setting is faster at every size: the pause paces the copies as well as clearing the handoffs
 * (even GPT-2 small, whose only mid-stage slots are stage E's, is slower without it). So the defaults
 * here stay GPT-2 small's, and each larger size and dtype is compiled with its own (gpt2/fast/plan.py's
 * STEP_SWITCHES, passed as -D options): the best of the settings tried, by position 64, 200 and 600
 * (H200, `tools/step_variants.py --position 64,200,600`, one device session, us a token, each the median
 * of 4 rounds that spread 0.1-0.6%; defaults / chosen at 64, at 200, at 600):
 *   gpt2-medium float32   DELAY_MID_STAGE 0                       577.8 / 573.8, 580.8 / 576.6, 615.7 / 600.2
 *   gpt2-medium bfloat16  both 0, ISSUE_DELAY_NS 150              386.2 / 380.7, 388.4 / 378.7, 393.9 / 375.8
 *   gpt2-large  float32   DELAY_EMPTY 0, ISSUE_DELAY_NS 700       1,176.8 / 1,120.0, 1,174.0 / 1,117.5, 1,203.7 / 1,163.0
 *   gpt2-large  bfloat16  DELAY_MID_STAGE 0, PROJ_GROUP 20        768.0 / 765.3, 805.7 / 796.0, 839.2 / 818.8
 *   gpt2-xl     float32   both 0, ISSUE_DELAY_NS 1200             2,149.9 / 2,097.9, 2,182.6 / 2,102.9, 2,213.8 / 2,133.3
 *   gpt2-xl     bfloat16  DELAY_MID_STAGE 0, ISSUE_DELAY_NS 400   1,507.4 / 1,477.4, 1,517.9 / 1,488.7, 1,545.1 / 1,509.8
 * Two of these are thin where the context is short: medium float32 0.7% at 64 and 200 (2.5% at 600),
 * large bfloat16 0.4% at 64 (1.2% and 2.4% after). In the same runs, not chosen: xl float32 both 0 with
 * 1,600 or 2,000 ns (2,100.6 / 2,105.4 / 2,147.4 and 2,116.0 / 2,121.7 / 2,173.6); xl bfloat16 with 600
 * ns about as fast as 400 (1,477.2 / 1,491.1 / 1,504.9), both 0 with 400 ns slower; large float32
 * DELAY_EMPTY 0 alone (1,141.0 / 1,138.4 / 1,151.9: faster at 600 only), with 400 ns slower, both 0
 * slower; large bfloat16 PROJ_GROUP 20 alone (764.3 / 806.6 / 827.0), with DELAY_EMPTY 0 slower; medium
 * bfloat16 both 0 with 250 or 400 ns a little slower than with 150; medium float32 DELAY_EMPTY 0 no better
 * at 64 and 200. GPT-2 small keeps the defaults: in a later run at the same positions (rounds spread
 * 0.3-1.4% there) DELAY_MID_STAGE 0, DELAY_EMPTY 0 or both were slower in both dtypes by 1-4%, and
 * ISSUE_DELAY_NS 150 in bfloat16 (152.0 / 153.0 / 160.3 against 152.7 / 154.2 / 161.8) and 400 in float32
 * (204.3 / 204.3 / 213.4 against 207.5 / 206.3 / 216.4) faster by about one spread, where an earlier
 * build measured 400 slower than 550 in float32 (above): not a choice to fit to one run. At gpt2-xl in
 * float32, REDUCE_HEADS with the chosen pause against without: 2,100.0 / 2,101.0 / 2,131.3 against
 * 2,156.8 / 2,155.1 / 2,185.4, so it stays. `bench.py e2e` before and after (docs/decode.md#scale):
 * gpt2-xl float32 465.2 -> 476.8 tokens/s, large float32 854.7 -> 896.2.
 *
 * The barrier. One counter, never reset: block 0 adds 2^31 - (G - 1), every other block adds 1, so
 * the top bit flips exactly when all G blocks have arrived and the low bits return to zero, and the
 * next barrier flips it back (the scheme of cooperative groups' grid sync). Thread 0 arrives with an
 * acquire-release add; the last to arrive sees the flip in its own add and leaves at once, the others
 * poll with acquire loads. The release's fence waits for the SM's memory traffic in flight, the
 * weight stream's copies too, so the block hands its slot back to the producer after the arrival.
 * What the barrier's ordering costs (H200, float32, `tools/step_variants.py`): a relaxed add and
 * relaxed polls, which order nothing, made the step 3.6% faster (with the slot handed back before
 * the arrival, which gained 1.2% since). Later, in bfloat16 (H200, position 264, same run): the
 * barrier and the read of every block's maximum replaced by one handoff of LL-like words (the
 * maximum, its row and the epoch's low bits; a release store, acquire loads) was no faster, 146.2
 * against 146.3 us a token; the same with relaxed accesses, which order nothing, 144.9 against 145.7.
 * Everything a block reads that another block wrote in this launch is read through L2 (handoff words,
 * fresh()): an SM's L1 is not coherent. The grid must be co-resident: the engine launches it
 * cooperatively, G = SM count.
 *
 * Stage E. LN_f is folded into the rows of wte as ln_1 and ln_2 are into theirs (wte has no bias: the
 * fold's second half is sum_k wte_nk beta_k). wte is 77 MB in bfloat16 and stage E reads it at about
 * the copy ceiling, so every byte it need not read counts: each block keeps its first lm_keep rows in
 * the shared memory the ring leaves over (KeptRows, copied once per launch, with LN_f's weight and
 * the rows' folds) and computes them first, while its first streamed chunks land. H200, bfloat16,
 * us a token at 264, same run: 18 rows kept (3 slots) 146.7 against 148.6 without; 57 (2 slots) 146.8
 * against 148.4. Folding LN_f itself did not measure as a gain: with 18 and 57 rows kept and LN_f
 * applied first as before (every warp's statistics, then x normalized), 147.8 and 146.4. Those
 * differences are within what code layout alone moves: the previous kernel with one statement
 * reordered, or one unused mbarrier more, ran 1.0 to 1.4 us a token slower than itself.
 *
 * Numerics as in the per-operation kernels, but for the parity words' last bit and the folded
 * LayerNorms above: float32 accumulation, LayerNorm's statistics two-pass (by one warp), the key and value
 * rounded to the cache's dtype, the argmax's first index of the largest logit (NaN never chosen; all
 * NaN gives token 0). Summation orders differ from gemv.cu (a row is split into parts over warps,
 * rows_dot), so logits match it to rounding, not bit for bit; the kernel itself is deterministic
 * (fixed orders, no atomics in the arithmetic).
 *
 * Template parameters: weight_t (float or bfloat16 bits, also the cache's type), C (n_embd), NH, HS
 * (head size, a multiple of 32 dividing THREADS), F (MLP width), THREADS, REDUCE_HEADS (the heads' terms
 * of attn.c_proj summed by each block for its columns of x and handed on, reduce_heads, or summed whole in
 * every block, proj_input; gpt2/fast/plan.py's step_reduce_heads). Geometry (gpt2/fast/plan.py,
 * step_plan): grid G (one block per SM, cooperative), block THREADS + 32 (the compute warps and the
 * producer), dynamic shared memory 128 bytes of mbarriers + nslot * slot_bytes + F floats (the input
 * vector, also stage B's scores) + C floats (the layer's input x) + the layer table (struct Layer,
 * copied from `layers` at the start) + the kept rows of wte (KeptRows). rows_a ... rows_d: the rows
 * of an item of stages A-D (stage B: rows of HS weights), from which every block counts the same
 * items (Stream::count_items). Needs sm_90 (cp.async.bulk, mbarrier transaction counts).
 * trace (may be null): the global timer, (steps, 4 * n_layer + 1, G, TRACE_MARKS), at each block's end of a
 * stage (0) and at its start of the next with its inputs in hand (1), for Engine.profile_persistent;
 * with TRACE_MARKS 6 (a diagnostic build, tools/step_trace.py --detail), stage B's row also marks the
 * split's own attention done, its partial stored (2), the head's partials in hand (3), y_h combined (4)
 * and, where stage B is one item, the projection done (5), after which that build projects again, the
 * same rows into the same words: the second pass runs the code the first brought into the instruction
 * caches, on the same data in shared memory.
 */
#include "common.cuh"

#define MAX_SPLITS 12  // key splits per head, at most (stage B holds one value of each in registers)
#define MAX_SLOTS 8    // the weight stream's slots, at most (two mbarriers each in the first 128 bytes)
#ifndef POLL_SLEEP_NS
#define POLL_SLEEP_NS 40  // between polls of the grid barrier (H200, then 13 barriers a token: 0 / 40 / 100 ns alike)
#endif
#ifndef ISSUE_DELAY_NS  // the producer's pause between a slot coming free and its next copy (see the header)
#define ISSUE_DELAY_NS (sizeof(weight_t) == 2 ? 250 : 550)
#endif
#ifndef DELAY_MID_STAGE  // 1: the pause also where an item in the middle of a stage freed the slot (no handoff)
#define DELAY_MID_STAGE 1
#endif
#ifndef DELAY_EMPTY  // 1: the pause also before an empty item (no copy)
#define DELAY_EMPTY 1
#endif
#ifndef PROJ_GROUP  // heads' loads a thread keeps in flight in proj_input where NH > 12 (all of them where NH <= 12):
#define PROJ_GROUP 10  // 16 or 20 (one round trip at medium and large) spill at medium bfloat16 and large float32
#endif
#ifndef TRACE_MARKS
#define TRACE_MARKS 2  // global-timer marks a block and stage in `trace` (6: stage B's inside too)
#endif
#ifndef LL_SLEEP_NS
#define LL_SLEEP_NS 0  // between rounds of reloads of stale handoff words (20 ns: 1% slower)
#endif


// One layer's pointers, in the order gpt2/fast/engine.py writes them (Engine.layer_table).
template <typename weight_t>
struct Layer {
    const weight_t* w_attn; const weight_t* w_proj; const weight_t* w_fc; const weight_t* w_mlp;  // (out, in)
    const float2* fold_attn; const float* b_proj; const float2* fold_fc; const float* b_mlp;  // fold: see the header
    const float* ln1_w; const float* ln2_w;
    weight_t* k_cache; weight_t* v_cache;  // (NH, max_len, HS)
};

// -- the weight stream: bulk copies into shared memory, completion by mbarrier ----------------------

__device__ __forceinline__ unsigned int smem_addr(const void* p) { return (unsigned int)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned int count = 1)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Expect `bytes` on bar and arrive: the phase completes when they have landed.
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned int bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned int parity)
{
    unsigned int done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long* bar)
{
    if (bytes == 0) return;
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// Bring `bytes` at p (16-byte aligned, a multiple of 16) into L2, asynchronously.
__device__ __forceinline__ void l2_prefetch(const void* p, unsigned int bytes)
{
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// Spin for about ns nanoseconds (the global timer).
__device__ __forceinline__ void spin_ns(unsigned int ns)
{
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < ns);
}

// -- synchronization: the compute warps, the grid ---------------------------------------------------

// __syncthreads() of the compute warps only (the producer warp never waits with them): named barrier 1.
template <int THREADS>
__device__ __forceinline__ void compute_sync() { asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory"); }

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// The grid barrier, in two halves. Arrive: acquire-release on the add; returns whether this block was
// the last (its add flipped the top bit), in which case it has acquired every other block's release
// and need not wait. Wait: poll until the top bit differs from the ticket's.
__device__ __forceinline__ bool grid_arrive(unsigned int* counter, bool leader, unsigned int count, unsigned int& ticket)
{
    const unsigned int add = leader ? 0x80000000u - (count - 1) : 1u;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(ticket) : "l"(counter), "r"(add) : "memory");
    return ((ticket + add) ^ ticket) & 0x80000000u;
}

__device__ __forceinline__ void grid_wait(const unsigned int* counter, unsigned int ticket)
{
    unsigned int now;
    while (true) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(counter) : "memory");
        if ((now ^ ticket) & 0x80000000u) return;
#if POLL_SLEEP_NS > 0
        __nanosleep(POLL_SLEEP_NS);
#endif
    }
}

// -- handoffs that carry their data (the LL protocol) ----------------------------------------------
// A value one block hands to others: the float in the low half of an 8-byte word, the step's epoch in
// the high half, stored and loaded as one 8-byte access (single-copy atomic). A reader that sees this
// step's epoch has the value with it: no fence, no barrier, and it waits only for the blocks whose
// values it reads. Words from earlier steps carry earlier epochs (ll_epoch: no repeat within 2^32 steps).

__device__ __forceinline__ void ll_store(unsigned long long* p, float v, unsigned int epoch)
{
    const unsigned long long w = ((unsigned long long)epoch << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}

__device__ __forceinline__ unsigned long long ll_word(const unsigned long long* p)
{
    unsigned long long w;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
    return w;
}

__device__ __forceinline__ float ll_float(unsigned long long w) { return __uint_as_float((unsigned int)w); }

// w[k] = the word at at(k) (none where at(k) is null, `settled` in its place) once current(w[k]). The
// loads go out together, and so do the reloads of the words still stale: a round trip per round, not
// per word. Polling more often made every handoff slower: once the first round found stale words, a
// second round in flight beside the first, 150 / 300 / 600 cycles behind it (for up to 4 words a
// thread), made the step 10 / 13 / 20 us a token slower (H200, bfloat16, position 264, same run).
template <typename Word, int N, typename At, typename Load, typename Current>
__device__ __forceinline__ void gather(Word (&w)[N], At at, Word settled, Load load, Current current)
{
#pragma unroll
    for (int k = 0; k < N; ++k) w[k] = at(k) != nullptr ? load(at(k)) : settled;
    while (true) {
        bool stale = false;
#pragma unroll
        for (int k = 0; k < N; ++k) stale |= !current(w[k]);
        if (!stale) return;
#if LL_SLEEP_NS > 0
        __nanosleep(LL_SLEEP_NS);
#endif
#pragma unroll
        for (int k = 0; k < N; ++k)
            if (!current(w[k])) w[k] = load(at(k));
    }
}

// w[k] = the LL word at at(k) once it carries epoch.
template <int N, typename At>
__device__ __forceinline__ void ll_gather(unsigned long long (&w)[N], At at, unsigned int epoch)
{
    gather(w, at, (unsigned long long)epoch << 32, ll_word,
           [&](unsigned long long v) { return (unsigned int)(v >> 32) == epoch; });
}

// -- handoffs of many values: parity words ---------------------------------------------------------
// Where every block reads what every block wrote (x, g, the heads' terms of attn.c_proj), the bytes
// read through L2 are the cost: 4-byte words in place of LL's 8. A parity word is the float with its
// lowest mantissa bit replaced by the step's parity (epoch & 1): one bit tells this step's value from
// the last step's, and no older one is left, because every word of these buffers is written in every
// step. The value is the word itself (a float one unit in the last place off at most; an infinity
// becomes a NaN); a reader that sees this step's parity in all of its words has the values.

__device__ __forceinline__ void pw_store(unsigned int* p, float v, unsigned int epoch)
{
    const unsigned int w = (__float_as_uint(v) & ~1u) | (epoch & 1u);
    asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(w) : "memory");
}

// Four words at p (16-byte aligned), each loaded as one access.
__device__ __forceinline__ uint4 pw_load4(const unsigned int* p)
{
    uint4 w;
    asm volatile("ld.relaxed.gpu.global.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "l"(p) : "memory");
    return w;
}

__device__ __forceinline__ bool pw_stale(const uint4& w, unsigned int epoch)
{
    return ((w.x ^ epoch) | (w.y ^ epoch) | (w.z ^ epoch) | (w.w ^ epoch)) & 1u;
}

__device__ __forceinline__ float4 pw_float4(const uint4& w)
{
    return make_float4(__uint_as_float(w.x), __uint_as_float(w.y), __uint_as_float(w.z), __uint_as_float(w.w));
}

__device__ __forceinline__ float4 times(float4 a, float4 b) { return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w); }

// w[k] = the four parity words at at(k) once all carry epoch's parity.
template <int N, typename At>
__device__ __forceinline__ void pw_gather(uint4 (&w)[N], At at, unsigned int epoch)
{
    const unsigned int p = epoch & 1u;
    gather(w, at, make_uint4(p, p, p, p), pw_load4, [&](const uint4& v) { return !pw_stale(v, epoch); });
}

// x_s = the K values at src of this step (and a copy into `keep`, and the values times ln_w into
// `scaled`, when given): a thread's vectors of four all at once, up to 8 (32 values).
template <int K, int THREADS>
__device__ __forceinline__ void pw_input(const unsigned int* src, unsigned int epoch, float* x_s, float* keep,
                                         float* scaled = nullptr, const float* ln_w = nullptr)
{
    static_assert(K % 4 == 0, "whole vectors of four");
    constexpr int K4 = K / 4, BATCH = (K4 + THREADS - 1) / THREADS < 8 ? (K4 + THREADS - 1) / THREADS : 8;
    for (int i0 = threadIdx.x; i0 < K4; i0 += BATCH * THREADS) {
        uint4 w[BATCH];
        pw_gather(w, [&](int k) { return i0 + k * THREADS < K4 ? src + 4 * (i0 + k * THREADS) : nullptr; }, epoch);
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const int i = i0 + k * THREADS;
            if (i < K4) {
                const float4 v = pw_float4(w[k]);
                reinterpret_cast<float4*>(x_s)[i] = v;
                if (keep != nullptr) reinterpret_cast<float4*>(keep)[i] = v;
                if (scaled != nullptr) reinterpret_cast<float4*>(scaled)[i] = times(v, reinterpret_cast<const float4*>(ln_w)[i]);
            }
        }
    }
    compute_sync<THREADS>();
}

// -- rows of a matrix against a vector, from shared memory -------------------------------------------

// Block b's rows of an N-row matrix (of G blocks): [first, first + count), ceil(N / G) per block.
struct Share { int first, count; };
__device__ __forceinline__ Share share(int N, int b, int G)
{
    const int per = (N + G - 1) / G, first = min(N, b * per);
    return {first, min(N, first + per) - first};
}

// Item j of a share streamed `rows` rows an item: its rows [j * rows, (j + 1) * rows) of the share, clipped.
__device__ __forceinline__ Share piece(Share s, int j, int rows)
{
    const int a = min(s.count, j * rows), e = min(s.count, (j + 1) * rows);
    return {s.first + a, e - a};
}


// The dot products of R rows of K weights at W_s with in_s (K floats), from shared memory. A row is
// cut into P parts of at most 768 weights; a task is U rows' same part, a warp's: each lane loads its
// 16-byte vectors of the part's inputs once (at most 6 in float32, 3 vectors of 8 in bfloat16) and
// uses them for all U rows, whose weights it loads at once, accumulating each row in two independent
// chains and reducing the U rows' sums in interleaved shuffle trees; the parts are then summed in
// order. Shared memory's bandwidth is the limit here: read once per row, the inputs would cost as
// much as the weights (more in bfloat16). Handing each row's value to the caller's epilogue from the
// lane that holds it, without the sums in red and two syncs, was no faster in bfloat16 and 4% slower
// in float32 (H100).
// Returns row threadIdx.x's value in threads below R. Ends with every thread past its reads of W_s
// and in_s.
template <typename weight_t, int K, int THREADS>
__device__ __forceinline__ float rows_dot(const weight_t* W_s, const float* in_s, int R, float* red)
{
    constexpr int WARPS = THREADS / 32, VEC = Vec16<weight_t>::N, CHUNKS = K / VEC;
    constexpr int P = (K + 767) / 768;
    constexpr int ITERS = ((CHUNKS + P - 1) / P + 31) / 32, SPAN = 32 * ITERS;  // whole rounds of 32 lanes
    // rows of a task: 3 in bfloat16; 1 in float32, where a row's weights are as many bytes as its inputs
    // (2 gained about 1% on GPT-2 small and spilled past 168 registers on medium and xl). In bfloat16,
    // 2 where that still takes a single round of the warps (stage A's 18 rows: 9 tasks, not 6) was
    // about 1 us a token slower (H200, position 264).
    constexpr int U = VEC == 8 ? 3 : 1;
    static_assert(K % VEC == 0, "rows are whole 16-byte vectors");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int tasks = (R + U - 1) / U * P;
    for (int t = warp; t < tasks; t += WARPS) {
        const int first = (t % P) * SPAN, r0 = t / P * U, rows = min(U, R - r0);
        uint4 w[U][ITERS];
#pragma unroll
        for (int j = 0; j < U; ++j) {
            if (j >= rows) break;  // the same in every lane
            const uint4* row = reinterpret_cast<const uint4*>(W_s + (long long)(r0 + j) * K);
#pragma unroll
            for (int i = 0; i < ITERS; ++i) {
                const int c = first + i * 32 + lane;
                if (i * 32 + lane < SPAN && c < CHUNKS) w[j][i] = row[c];
            }
        }
        float acc[U][2];
#pragma unroll
        for (int j = 0; j < U; ++j) acc[j][0] = acc[j][1] = 0.0f;
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
            const int c = first + i * 32 + lane;
            if (i * 32 + lane >= SPAN || c >= CHUNKS) break;  // past the part (lanes ascend with i)
            float x[VEC];  // this lane's inputs of vector i, once for the U rows
            const float4* xv = reinterpret_cast<const float4*>(in_s + c * VEC);
            if (VEC == 4) {
                const float4 a = xv[0];
                x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
            } else {  // lanes 4-7 of each 8 take the upper half first: a phase's 8 lanes hit all 32 banks
                const int h = (lane >> 2) & 1;
                const float4 a = xv[h], b = xv[h ^ 1], lo = h ? b : a, hi = h ? a : b;
                x[0] = lo.x; x[1] = lo.y; x[2] = lo.z; x[3] = lo.w;
                x[VEC - 4] = hi.x; x[VEC - 3] = hi.y; x[VEC - 2] = hi.z; x[VEC - 1] = hi.w;
            }
#pragma unroll
            for (int j = 0; j < U; ++j) {
                if (j >= rows) break;
                float wv[VEC];
                unpack(w[j][i], wv);
#pragma unroll
                for (int e = 0; e < VEC / 4; ++e) {
                    float& a = acc[j][(i * (VEC / 4) + e) % 2];
                    a = fmaf(wv[4 * e + 0], x[4 * e + 0], a);
                    a = fmaf(wv[4 * e + 1], x[4 * e + 1], a);
                    a = fmaf(wv[4 * e + 2], x[4 * e + 2], a);
                    a = fmaf(wv[4 * e + 3], x[4 * e + 3], a);
                }
            }
        }
        float total[U];
#pragma unroll
        for (int j = 0; j < U; ++j) total[j] = acc[j][0] + acc[j][1];
#pragma unroll
        for (int o = 16; o > 0; o /= 2)
#pragma unroll
            for (int j = 0; j < U; ++j) total[j] += __shfl_xor_sync(0xffffffffu, total[j], o);
        if (lane == 0)
#pragma unroll
            for (int j = 0; j < U; ++j)
                if (j < rows) red[(r0 + j) * P + t % P] = total[j];
    }
    compute_sync<THREADS>();
    float v = 0.0f;
    if ((int)threadIdx.x < R)
        for (int p = 0; p < P; ++p) v += red[threadIdx.x * P + p];
    compute_sync<THREADS>();
    return v;
}

// LayerNorm's statistics of the K floats at x_s, by one warp: two passes, over values it keeps in
// registers where they fit (K <= 1024); lane 0 writes out[0] = mean, out[1] = 1 / sqrt(variance + eps).
template <int K>
__device__ __forceinline__ void layernorm_stats(const float* x_s, float eps, float* out)
{
    static_assert(K % 4 == 0, "whole float4 vectors");
    constexpr int N = (K / 4 + 31) / 32, KEPT = N <= 8 ? N : 1;
    const float4* x4 = reinterpret_cast<const float4*>(x_s);
    const int lane = threadIdx.x % 32;
    float4 kept[KEPT];
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const int i = lane + 32 * j;
        const float4 v = i < K / 4 ? x4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (N == KEPT) kept[j % KEPT] = v;
        s += (v.x + v.y) + (v.z + v.w);
    }
    const float mean = warp_sum(s) / K;
    float m2 = 0.0f;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const int i = lane + 32 * j;
        if (i < K / 4) {
            const float4 v = N == KEPT ? kept[j % KEPT] : x4[i];
            const float a = v.x - mean, b = v.y - mean, c = v.z - mean, d = v.w - mean;
            m2 += fmaf(a, a, b * b) + fmaf(c, c, d * d);
        }
    }
    m2 = warp_sum(m2);
    if (lane == 0) { out[0] = mean; out[1] = 1.0f / sqrtf(m2 / K + eps); }
}

// out[first + r] = W_s[r] . y_s for the rows of `rows` (HS weights each, from shared memory), handed
// over as parity words: a thread takes 64 bytes of a row (four 16-byte vectors: 32 weights in bfloat16,
// 16 in float32), the row's threads summed by shuffles. In bfloat16 that is two threads a row, and
// GPT-2 small's 128 rows a split take one pass of the block; with 16 weights a thread (two passes)
// the step was 2.5 us a token slower (H200, position 264, same run: 149.1 against 146.6).
template <typename weight_t, int HS, int THREADS>
__device__ __forceinline__ void head_rows_dot(const weight_t* W_s, const float* y_s, Share rows, unsigned int* out,
                                              unsigned int epoch)
{
    constexpr int VEC = Vec16<weight_t>::N, N = 64 / sizeof(weight_t), Q = HS / N, PER = THREADS / Q;
    static_assert(HS % N == 0 && 32 % Q == 0, "a row's threads sit in one warp");
    const int part = threadIdx.x % Q;
    const float4* y4 = reinterpret_cast<const float4*>(y_s + part * N);
    for (int r0 = 0; r0 < rows.count; r0 += PER) {  // the same trips in every thread: the shuffles need them all
        const int r = r0 + (int)threadIdx.x / Q;
        float acc[2] = {0.0f, 0.0f};
        if (r < rows.count) {
            const uint4* w = reinterpret_cast<const uint4*>(W_s + (long long)r * HS + part * N);
#pragma unroll
            for (int i = 0; i < N / VEC; ++i) {
                float wv[VEC];
                unpack(w[i], wv);
#pragma unroll
                for (int e = 0; e < VEC / 4; ++e) {
                    const float4 y = y4[i * (VEC / 4) + e];
                    float& a = acc[(i * (VEC / 4) + e) % 2];
                    a = fmaf(wv[4 * e + 0], y.x, a);
                    a = fmaf(wv[4 * e + 1], y.y, a);
                    a = fmaf(wv[4 * e + 2], y.z, a);
                    a = fmaf(wv[4 * e + 3], y.w, a);
                }
            }
        }
        float v = acc[0] + acc[1];
#pragma unroll
        for (int o = Q / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (r < rows.count && part == 0) pw_store(out + rows.first + r, v, epoch);
    }
}

// x_s = x_in + (b + sum_h proj_h), the heads in order (every block the same sum), proj_h this step's
// parity words, and scaled = x_s times ln_w; x_in is in shared memory (x_s may be x_in: a thread
// writes only what it read), b a weight. Up to 12 heads' loads in flight at once (GPT-2 small's all); 10 where there are more (in
// twelves, gpt2-xl's 25 spilled past 168 registers).
// (b streamed into shared memory with stage C's item, like every other vector a stage reads, was 1.2 us
// a token slower in bfloat16 and 2.0 faster in float32; prefetched into L2 during stage A, no change:
// H200, position 264, same run)
template <int C, int NH, int THREADS>
__device__ __forceinline__ void proj_input(const float* x_in, const unsigned int* proj, unsigned int epoch,
                                           const float* bias, float* x_s, float* scaled, const float* ln_w)
{
    constexpr int GROUP = NH <= 12 ? NH : PROJ_GROUP < NH ? PROJ_GROUP : NH;
    for (int i = threadIdx.x; i < C / 4; i += THREADS) {
        const float4 xv = reinterpret_cast<const float4*>(x_in)[i];
        float4 t = __ldg(reinterpret_cast<const float4*>(bias) + i);
#pragma unroll
        for (int h0 = 0; h0 < NH; h0 += GROUP) {
            uint4 w[GROUP];
            pw_gather(w, [&](int j) { return h0 + j < NH ? proj + (h0 + j) * C + 4 * i : nullptr; }, epoch);
#pragma unroll
            for (int j = 0; j < GROUP; ++j)
                if (h0 + j < NH) {
                    const float4 v = pw_float4(w[j]);
                    t.x += v.x; t.y += v.y; t.z += v.z; t.w += v.w;
                }
        }
        const float4 v = make_float4(xv.x + t.x, xv.y + t.y, xv.z + t.z, xv.w + t.w);
        reinterpret_cast<float4*>(x_s)[i] = v;
        reinterpret_cast<float4*>(scaled)[i] = times(v, reinterpret_cast<const float4*>(ln_w)[i]);
    }
    compute_sync<THREADS>();
}

// The heads' terms summed once, not in every block (REDUCE_HEADS): block b's share of x's 16-byte
// columns, x_in + (b + sum_h proj_h) with the same additions in the same order as proj_input, handed on
// as parity words (out), which stage C then gathers as it gathers x after stage D (pw_input). proj_input
// reads every head's term of every column in every block: NH * C words, C / 4 columns over THREADS
// threads at most 10 heads' loads in flight, so gpt2-xl's 25 heads of 400 columns take 6 round trips
// through L2 one after another in a thread that has two columns. Here a block's share is at most
// ceil(C / 4 / G) columns of NH words, all in flight at once, and the one more handoff costs a round
// trip. scratch: NH * ceil(C / 4 / G) float4 of shared memory (stage B's scores' place, free by then).
template <int C, int NH, int THREADS>
__device__ __forceinline__ void reduce_heads(const float* x_in, const unsigned int* proj, unsigned int epoch,
                                             const float* bias, float* scratch, unsigned int* out)
{
    const Share s = share(C / 4, blockIdx.x, gridDim.x);  // columns of four
    float4* part = reinterpret_cast<float4*>(scratch);      // [head][column of the share]
    for (int t = threadIdx.x; t < NH * s.count; t += THREADS) {
        uint4 w[1];
        pw_gather(w, [&](int) { return proj + (t / s.count) * C + 4 * (s.first + t % s.count); }, epoch);
        part[t] = pw_float4(w[0]);
    }
    compute_sync<THREADS>();
    if ((int)threadIdx.x < s.count) {
        const int i = s.first + threadIdx.x;
        float4 t = __ldg(reinterpret_cast<const float4*>(bias) + i);
        for (int h = 0; h < NH; ++h) {
            const float4 v = part[h * s.count + threadIdx.x];
            t.x += v.x; t.y += v.y; t.z += v.z; t.w += v.w;
        }
        const float4 xv = reinterpret_cast<const float4*>(x_in)[i];
        pw_store(out + 4 * i + 0, xv.x + t.x, epoch);
        pw_store(out + 4 * i + 1, xv.y + t.y, epoch);
        pw_store(out + 4 * i + 2, xv.z + t.z, epoch);
        pw_store(out + 4 * i + 3, xv.w + t.w, epoch);
    }
    compute_sync<THREADS>();  // scratch is the next stage's
}

// (best, arg) folded with (v, a): the larger value, the smaller index on ties, NaN never taken.
__device__ __forceinline__ void take_max(float& best, int& arg, float v, int a)
{
    if (v > best || (v == best && a < arg)) { best = v; arg = a; }
}

__device__ __forceinline__ void warp_argmax(float& best, int& arg)
{
#pragma unroll
    for (int o = 16; o > 0; o /= 2)
        take_max(best, arg, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, arg, o));
}

// Item j of a linear stage (the block's share in items of `rows` rows: piece), handed to emit(src, bytes)
// range by range: for a LayerNorm in front, in item 0, its weight (K floats: the input is scaled once,
// before the item's rows are needed), then the item's rows of W (count x K), then either the rows' folds
// (pairs of floats) or their biases, from the 16-byte boundary at or below the first (bulk copies move
// whole 16-byte units): row r's bias is at bias[first % 4 + r], its fold at fold[first % 2 + r]
// (LinearSlot).
template <typename weight_t, typename Emit>
__device__ __forceinline__ void linear_item(Emit& emit, const weight_t* W, int K, int N, const float* ln_w,
                                            const float2* fold, const float* bias, int j, int rows)
{
    const Share s = piece(share(N, blockIdx.x, gridDim.x), j, rows);
    if (ln_w != nullptr && j == 0) emit(ln_w, K * 4u);
    emit(W + (long long)s.first * K, s.count * K * (unsigned int)sizeof(weight_t));
    if (ln_w != nullptr) {
        const int a0 = s.first & ~1, a1 = min(N, (s.first + s.count + 1) & ~1);  // N is even
        emit(fold + a0, s.count > 0 ? (a1 - a0) * 8u : 0u);
    } else {
        const int a0 = s.first & ~3, a1 = min(N, (s.first + s.count + 3) & ~3);  // N is a multiple of 4
        emit(bias + a0, s.count > 0 ? (a1 - a0) * 4u : 0u);
    }
}

// Where rows of wte and their folds sit: `rows` rows from row `first` at `at`, their folds from the
// 16-byte boundary at or below the first at `folds` (wte_rows). A stage E item has its folds right
// after its rows; the kept rows have LN_f's weight between (KeptRows). Row r's logit is
// folded(r, W_r . (ln_w * x), stats).
template <typename weight_t, int C>
struct LmRows {
    const weight_t* W;
    const float2* fold;
    __device__ __forceinline__ LmRows(const unsigned char* at, const unsigned char* folds, int first)
        : W(reinterpret_cast<const weight_t*>(at)), fold(reinterpret_cast<const float2*>(folds) + (first & 1)) {}
    __device__ __forceinline__ LmRows(const unsigned char* at, int rows, int first)
        : LmRows(at, at + (long long)rows * C * sizeof(weight_t), first) {}
    __device__ __forceinline__ float folded(int r, float a, const float* stats) const
    {
        return fmaf(stats[1], fmaf(-stats[0], fold[r].x, a), fold[r].y);
    }
};

// The kept rows (room for `keep` of them from row first), then LN_f's weight (C floats), then the folds.
template <typename weight_t, int C>
struct KeptRows : LmRows<weight_t, C> {
    float* ln_w;
    __device__ __forceinline__ KeptRows(unsigned char* at, int keep, int first)
        : LmRows<weight_t, C>(at, at + (long long)keep * C * sizeof(weight_t) + C * 4, first),
          ln_w(reinterpret_cast<float*>(at + (long long)keep * C * sizeof(weight_t))) {}
};

// What block blockIdx.x reads, item by item: item i is item i % per_step of step i / per_step. A step
// is n_layer layers of per_layer items (stage s of a layer: items[s] items of at most rows[s] rows,
// stages A-D), then lm_chunks chunks of wte.
template <typename weight_t, int C, int NH, int HS, int F>
struct Stream {
    const Layer<weight_t>* layers;  // in shared memory
    const weight_t* wte;
    const float2* lnf_fold;  // per row of wte: LN_f folded into it (see the header), V pairs and one more
    unsigned char* slots;
    unsigned long long* full;  // one mbarrier per slot
    int n_layer, V, max_len, splits, pos0, lm_keep, lm_rows, lm_chunks, nslot, slot_bytes;
    int* rows;   // per stage A-D, rows an item, in shared memory (read where used: not held in registers)
    int* items;  // per stage A-D, items a layer, in shared memory
    int per_layer, per_step;

    // rows[s] = per[s] and items[s] (thread 0 writes them), per_layer, per_step. Stage B's rows are a
    // split's sequence of rows of HS weights: its keys below pos, their values, its rows of W_proj[h]
    // (at most 2 ceil(max_len / splits) + ceil(C / splits)); the other stages' a block's share of the
    // matrix's rows.
    __device__ __forceinline__ void count_items(const int (&per)[4])
    {
        const int G = gridDim.x;
        const int most[4] = {(3 * C + G - 1) / G, 2 * ((max_len + splits - 1) / splits) + (C + splits - 1) / splits,
                             (F + G - 1) / G, (C + G - 1) / G};
        per_layer = 0;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int k = (most[s] + per[s] - 1) / per[s];
            if (threadIdx.x == 0) { rows[s] = per[s]; items[s] = k; }
            per_layer += k;
        }
        per_step = n_layer * per_layer + lm_chunks;
    }

    // Whether item i is the last of its stage: its release comes with the stage's handoff.
    __device__ __forceinline__ bool ends_stage(long long i) const
    {
        const int r = (int)(i % per_step);
        if (r >= n_layer * per_layer) return r + 1 == per_step;  // stage E's last chunk
        const int j = r % per_layer + 1;
        return j == items[0] || j == items[0] + items[1] || j == items[0] + items[1] + items[2] || j == per_layer;
    }

    // The bytes item i brings.
    __device__ __forceinline__ unsigned int bytes(long long i) const
    {
        unsigned int total = 0;
        auto count = [&](const void*, unsigned int n) { total += n; };
        ranges(i, count);
        return total;
    }

    // Whether item r of a step (i % per_step) is a stage B item (it reads the cache).
    __device__ __forceinline__ bool attention(int r) const
    {
        const int j = r % per_layer;
        return r < n_layer * per_layer && j >= items[0] && j < items[0] + items[1];
    }

    // The bytes of the folds of rows [first, first + n), from the 16-byte boundary at or below the first.
    static __device__ __forceinline__ unsigned int folds_bytes(int first, int n)
    {
        return n > 0 ? ((first + n + 1) / 2 * 2 - (first & ~1)) * 8u : 0u;
    }

    // n rows of wte from row first, then their folds (where they sit: LmRows)
    template <typename Emit>
    __device__ __forceinline__ void wte_rows(Emit& emit, int first, int n) const
    {
        emit(wte + (long long)first * C, n * C * (unsigned int)sizeof(weight_t));
        emit(lnf_fold + (first & ~1), folds_bytes(first, n));
    }

    // Item i's ranges of global memory, in the order they land in the slot, to emit(src, bytes).
    template <typename Emit>
    __device__ __forceinline__ void ranges(long long i, Emit& emit) const
    {
        constexpr int ITEM = (int)sizeof(weight_t);
        const int b = blockIdx.x;
        const int step = (int)(i / per_step), r = (int)(i % per_step);
        if (r >= n_layer * per_layer) {  // chunk k of the block's streamed rows of wte (past the kept ones)
            const Share s = share(V, b, gridDim.x);
            const int k = r - n_layer * per_layer, n = max(0, min(lm_rows, s.count - lm_keep - k * lm_rows));
            wte_rows(emit, s.first + lm_keep + k * lm_rows, n);
            return;
        }
        const Layer<weight_t>& L = layers[r / per_layer];
        int j = r % per_layer;
        if (j < items[0]) {
            linear_item(emit, L.w_attn, C, 3 * C, L.ln1_w, L.fold_attn, nullptr, j, rows[0]);
        } else if ((j -= items[0]) < items[1]) {
            if (b / splits < NH) {  // rows [j * rows[1], ...) of the split's sequence: its cached rows below pos
                // (the row at pos is this step's), their values, its rows of the head's attn.c_proj columns
                // (W_proj head-major: (NH, C, HS))
                const int pos = pos0 + step, chunk = (pos + 1 + splits - 1) / splits;
                const int k0 = min(pos, (b % splits) * chunk), staged = min(pos, k0 + chunk) - k0;
                const long long at = ((long long)(b / splits) * max_len + k0) * HS;
                const Share proj = share(C, b % splits, splits);
                const int lo = j * rows[1], hi = lo + rows[1];
                // the part of the sequence's rows [first, first + count), which sit at src, in this item
                auto part = [&](const weight_t* src, int first, int count) {
                    const int a = max(lo, first), e = min(hi, first + count);
                    if (a < e) emit(src + (long long)(a - first) * HS, (e - a) * HS * ITEM);
                };
                part(L.k_cache + at, 0, staged);
                part(L.v_cache + at, staged, staged);
                part(L.w_proj + ((long long)(b / splits) * C + proj.first) * HS, 2 * staged, proj.count);
            }
        } else if ((j -= items[1]) < items[2]) {
            linear_item(emit, L.w_fc, C, F, L.ln2_w, L.fold_fc, nullptr, j, rows[2]);
        } else {
            linear_item<weight_t>(emit, L.w_mlp, F, C, nullptr, nullptr, L.b_mlp, j - items[2], rows[3]);
        }
    }

    // The rows of wte the block keeps in shared memory for every step (its first lm_keep, at most), their
    // folds and LN_f's weight, into `kept` as KeptRows lays them out; completion on bar (the producer).
    __device__ __forceinline__ void keep(unsigned char* kept, const float* lnf_w, unsigned long long* bar) const
    {
        const Share s = share(V, blockIdx.x, gridDim.x);
        const int n = max(0, min(lm_keep, s.count));
        const unsigned int row_bytes = n * C * (unsigned int)sizeof(weight_t), fold_bytes = folds_bytes(s.first, n);
        mbar_expect(bar, row_bytes + fold_bytes + C * 4u);
        const KeptRows<weight_t, C> at(kept, lm_keep, s.first);
        bulk_copy(const_cast<weight_t*>(at.W), wte + (long long)s.first * C, row_bytes, bar);
        bulk_copy(const_cast<float2*>(at.fold) - (s.first & 1), lnf_fold + (s.first & ~1), fold_bytes, bar);
        bulk_copy(at.ln_w, lnf_w, C * 4u, bar);
    }

    // Copy item i into slot i % nslot (one thread, the producer's): the bytes it expects, then the copies.
    __device__ __forceinline__ void issue(long long i) const
    {
        unsigned long long* bar = full + i % nslot;
        mbar_expect(bar, bytes(i));
        if (attention((int)(i % per_step)))  // cache rows, written by earlier steps' ordinary stores
            asm volatile("fence.proxy.async.global;" ::: "memory");
        unsigned char* dst = slots + (i % nslot) * slot_bytes;
        auto copy = [&](const void* src, unsigned int bytes) { bulk_copy(dst, src, bytes, bar); dst += bytes; };
        ranges(i, copy);
    }
};

// Where a linear stage's item sits in its slot (linear_item), for the item's rows s: with a LayerNorm in
// front (ln), its weight first in item 0 (first; at the slot's start: linear_ln_w) and the rows' folds
// after the rows, else the rows' biases.
template <typename weight_t>
struct LinearSlot {
    const weight_t* W;
    const float2* fold;
    const float* bias;
    __device__ __forceinline__ LinearSlot(const unsigned char* slot, Share s, int K, bool ln, bool first)
    {
        W = reinterpret_cast<const weight_t*>(slot + (ln && first ? K * 4 : 0));
        const float* after = reinterpret_cast<const float*>(W + (long long)s.count * K);
        fold = reinterpret_cast<const float2*>(after) + (s.first & 1);
        bias = after + (s.first & 3);
    }
    // Row r's LN(x) . W_r from a = W_r . (ln_w * x) and the statistics (mean, 1 / std) in stats.
    __device__ __forceinline__ float folded(int r, float a, const float* stats) const
    {
        return fmaf(stats[1], fmaf(-stats[0], fold[r].x, a), fold[r].y);
    }
};

// A LayerNorm's weight, at the start of a linear stage's item 0 (linear_item).
__device__ __forceinline__ const float* linear_ln_w(const unsigned char* slot) { return reinterpret_cast<const float*>(slot); }

// The block's share sh of a linear stage of K inputs, item by item from `in` (item 0, taken): each item's
// rows against in_s (rows_dot), then epi(in, r, n, v) in the threads below its row count (row r of the
// item, n of the matrix, v its dot product); between items the slot goes back (release) and the next
// comes (take). With one item a stage, one rows_dot and one epilogue, as before items were split.
template <typename weight_t, int K, int THREADS, typename Take, typename Release, typename Epilogue>
__device__ __forceinline__ void linear_items(LinearSlot<weight_t> in, Share sh, int rows, int items, bool ln,
                                             const float* in_s, float* red, Take& take, Release& release, Epilogue epi)
{
    for (int j = 0;;) {
        const Share it = piece(sh, j, rows);
        const float v = rows_dot<weight_t, K, THREADS>(in.W, in_s, it.count, red);
        if ((int)threadIdx.x < it.count) epi(in, (int)threadIdx.x, it.first + (int)threadIdx.x, v);
        if (++j == items) return;
        release();
        in = LinearSlot<weight_t>(take(), piece(sh, j, rows), K, ln, false);
    }
}

// Stage B's items: a split's sequence of rows of HS weights (its staged keys, their values, its rows of
// the head's W_proj[h]) in items of `per` rows, one held at a time. rows(lo, hi, f) calls f(at, first,
// count) for each item's part of rows [lo, hi), taking the items as it reaches them (the one before
// goes back to the producer: release); calls go up the sequence. With one item a stage (the whole
// sequence fits a slot) every part is in the item next() took first, as before items were split.
template <typename weight_t, int HS, typename Take, typename Release>
struct ItemRows {
    Take& take;
    Release& release;
    int per;
    int taken = 0;  // the stage's items taken; the last is held
    const unsigned char* held = nullptr;

    __device__ __forceinline__ void next()
    {
        if (taken > 0) release();
        held = take();
        ++taken;
    }

    template <typename Fn>
    __device__ __forceinline__ void rows(int lo, int hi, Fn f)
    {
        while (lo < hi) {
            const int t = lo / per, end = min(hi, (t + 1) * per);
            while (taken <= t) next();
            f(reinterpret_cast<const weight_t*>(held) + (long long)(lo - t * per) * HS, lo, end - lo);
            lo = end;
        }
    }
};

template <typename weight_t, int C, int NH, int HS, int F, int THREADS, bool REDUCE_HEADS>
__global__ void __launch_bounds__(THREADS + 32, 1)
decode_step(const Layer<weight_t>* __restrict__ layers, int n_layer, const weight_t* __restrict__ wte,
            const weight_t* __restrict__ wpe, const float* __restrict__ lnf_w, const float2* __restrict__ lnf_fold,
            float eps, int V, int max_len, int splits, float scale, float* x, unsigned int* pw_x,
            unsigned long long* ll_qkv, unsigned long long* ll_partial, unsigned int* pw_g, unsigned int* pw_proj,
            unsigned int* pw_xa, float* block_max, int* block_arg, float* logits, int* state, int* history, unsigned int* barrier,
            unsigned int* ll_epoch, int steps, int slot_bytes, int nslot, int rows_a, int rows_b, int rows_c, int rows_d,
            int lm_rows, int lm_keep, unsigned long long* trace)
{
    constexpr int WARPS = THREADS / 32;  // compute warps; warp WARPS is the producer
    static_assert(HS % 32 == 0 && THREADS % HS == 0, "head size: a multiple of 32 dividing THREADS");
    static_assert(C % 8 == 0, "rows of 16-byte vectors in either dtype");
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem);  // per slot: its item has landed
    unsigned long long* empty = full + MAX_SLOTS;                            // per slot: the block is done with it
    unsigned char* slots = smem + 16 * MAX_SLOTS;
    float* in_s = reinterpret_cast<float*>(slots + (long long)nslot * slot_bytes);  // F floats
    float* x_in = in_s + F;  // C floats: x, the LayerNorms' input (the layer's input, then x after attention)
    Layer<weight_t>* layer_s = reinterpret_cast<Layer<weight_t>*>(x_in + C);  // the layer table
    unsigned char* kept = reinterpret_cast<unsigned char*>(layer_s + n_layer);  // KeptRows: wte's rows kept
    __shared__ float red[THREADS];
    __shared__ float scratch[WARPS];
    __shared__ __align__(16) float q_s[HS];
    __shared__ float ml_s[2 * MAX_SPLITS];  // stage B: each split's score max and sum
    __shared__ int arg_s;
    __shared__ float ln_s[2];  // the LayerNorm's mean and 1 / std (layernorm_stats)
    __shared__ unsigned long long stepped;  // a phase per step: the compute warps have passed its last barrier
    __shared__ unsigned long long kept_bar;  // the kept rows have landed (once)
    __shared__ unsigned long long* trace_s;  // trace (mark)
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, G = gridDim.x, b = blockIdx.x;

    const int head = b / splits, split = b % splits;  // stage B's (head, key split); head >= NH: idle
    int token = state[0];
    const int pos0 = state[1];
    const unsigned int epoch0 = *ll_epoch;  // step s hands over its values with epoch epoch0 + s + 1
    // the same in every block, and at least 1: lm_keep < ceil(V / G) (gpt2/fast/plan.py's step_plan)
    const int lm_chunks = ((V + G - 1) / G - lm_keep + lm_rows - 1) / lm_rows;
    __shared__ int stage_rows[4], stage_items[4];
    Stream<weight_t, C, NH, HS, F> stream{layer_s, wte, lnf_fold, slots, full, n_layer, V, max_len, splits, pos0,
                                           lm_keep, lm_rows, lm_chunks, nslot, slot_bytes, stage_rows, stage_items};
    stream.count_items({rows_a, rows_b, rows_c, rows_d});  // the same counts in every block (gpt2/fast/plan.py)
    const long long items = (long long)steps * stream.per_step;
    const int stages = 4 * n_layer + 1;  // per step: the trace's second index

    for (int i = tid; i < n_layer * (int)(sizeof(Layer<weight_t>) / 8); i += blockDim.x)
        reinterpret_cast<unsigned long long*>(layer_s)[i] = reinterpret_cast<const unsigned long long*>(layers)[i];
    if (tid == 0) {
        for (int s = 0; s < nslot; ++s) { mbar_init(full + s); mbar_init(empty + s, THREADS); }
        mbar_init(&stepped);
        mbar_init(&kept_bar);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        trace_s = trace;
    }
    __syncthreads();  // the last barrier of the whole block: from here on the producer goes its own way

    // The producer warp: item i goes into its slot as soon as the block is done with item i - nslot.
    // It never waits at the grid barriers, so a copy that is slow to issue holds up nothing else. Only
    // stage B's items read what blocks wrote in this launch (the cache rows below pos, written by
    // earlier steps); those of step s wait until the compute warps have passed step s - 1's last grid
    // barrier, which orders every block's stores of that step before them.
    if (warp == WARPS) {
        if (lane == 0) {
            int passed = 0;  // steps whose last barrier the compute warps have passed, as far as seen
            for (long long i = 0; i < items; ++i) {
                const int step = (int)(i / stream.per_step), r = (int)(i % stream.per_step);
                for (; passed < step && stream.attention(r); ++passed) mbar_wait(&stepped, passed & 1);
                if (i >= nslot) {
                    mbar_wait(empty + i % nslot, (unsigned int)((i / nslot - 1) & 1));
                    if ((DELAY_MID_STAGE || stream.ends_stage(i - nslot)) && (DELAY_EMPTY || stream.bytes(i) > 0))
                        spin_ns(ISSUE_DELAY_NS);  // out of the way of the handoff that follows the release
                }
                stream.issue(i);
                if (i + 1 == min(items, (long long)nslot)) stream.keep(kept, lnf_w, &kept_bar);  // after the first items
            }
        }
        return;
    }

    long long item = 0;  // the next item to consume
    int stage = 0;       // stages done in this step (the trace's index)
    // Wait for the next item; its slot.
    auto take = [&]() { mbar_wait(full + item % nslot, (unsigned int)((item / nslot) & 1)); return slots + (item % nslot) * slot_bytes; };
    // Done with the item: once every compute thread is, the producer may refill its slot. Every compute
    // thread arrives for itself: the arrival orders that thread's reads of the slot before the copy that
    // refills it. One arrival by thread 0 after the named barrier orders them as well, but compute-sanitizer's
    // racecheck does not follow a bar.sync into an mbarrier and reports the refill as a race with lanes'
    // reads (tools/racecheck_ring.py: the report goes with thread 0's arrival, and every thread's clears it).
    auto release = [&]() { compute_sync<THREADS>(); mbar_arrive(empty + item % nslot); ++item; };
    // With a trace, thread 0 records the global timer: at a block's arrival (which 0) when its stage is
    // done, at its departure (which 1) when the next stage has its inputs.
    // (trace read from shared memory where used, not held in registers through the step: the larger
    // sizes' kernels sit at 168 registers, and a held trace made gpt2-medium's spill once items were split)
    auto mark = [&](int step, int k, int which) {
        if (which < TRACE_MARKS && tid == 0 && trace_s != nullptr)
            asm volatile("mov.u64 %0, %%globaltimer;"
                         : "=l"(trace_s[(((long long)step * stages + k) * gridDim.x + blockIdx.x) * TRACE_MARKS + which]));
    };
    // Done with the item and the stage; the next stage's inputs come as they are handed over (pw_input).
    auto handoff = [&](int step) { release(); mark(step, stage++, 0); };
    // Done with the item and the stage: wait for every block (thread 0 arrives and waits). The slot goes
    // back to the producer after the arrival: the release's fence waits for the SM's memory traffic in
    // flight, and the next item's copy would be part of it.
    auto finish = [&](int step) {
        compute_sync<THREADS>();
        mark(step, stage, 0);
        if (tid == 0) {
            unsigned int ticket;
            const bool last = grid_arrive(barrier, b == 0, G, ticket);
            mbar_arrive(empty + item % nslot);  // the last arrival: the slot goes back after the grid's
            if (!last) grid_wait(barrier, ticket);
        } else {
            mbar_arrive(empty + item % nslot);
        }
        ++item;
        mark(step, stage++, 1);
        compute_sync<THREADS>();
    };

    for (int step = 0; step < steps; ++step) {
        const int pos = pos0 + step;
        const unsigned int epoch = epoch0 + step + 1;
        stage = 0;
        for (int l = 0; l < n_layer; ++l) {
            const Layer<weight_t>& L = layer_s[l];
            unsigned long long* qkv_l = ll_qkv + (long long)l * 3 * C;
            unsigned int* proj_l = pw_proj + (long long)l * NH * C;
            Share sh;
            // A: qkv = LN_1(x) W_attn + b; the new key and value into the cache (rounded to its dtype)
            // (LayerNorm folded into the rows: the last warp finds its statistics while the others take
            // the rows' dot products with ln_1's weight times x)
            sh = share(3 * C, b, G);
            {
                const unsigned char* at = take();
                const float* ln_w = linear_ln_w(at);
                if (l == 0) {  // x = wte[token] + wpe[pos], in 16-byte vectors (their loads go out at once)
                    constexpr int VEC = Vec16<weight_t>::N;
                    for (int i = tid; i < C / VEC; i += THREADS) {
                        float t[VEC], p[VEC];
                        unpack(load16(wte + (long long)token * C + i * VEC), t);
                        unpack(load16(wpe + (long long)pos * C + i * VEC), p);
#pragma unroll
                        for (int e = 0; e < VEC / 4; ++e) {
                            const int k = i * (VEC / 4) + e;
                            const float4 v = make_float4(t[4 * e] + p[4 * e], t[4 * e + 1] + p[4 * e + 1],
                                                         t[4 * e + 2] + p[4 * e + 2], t[4 * e + 3] + p[4 * e + 3]);
                            reinterpret_cast<float4*>(x_in)[k] = v;
                            reinterpret_cast<float4*>(in_s)[k] = times(v, reinterpret_cast<const float4*>(ln_w)[k]);
                        }
                    }
                    compute_sync<THREADS>();
                } else {
                    pw_input<C, THREADS>(pw_x + (long long)(l - 1) * C, epoch, x_in, nullptr, in_s, ln_w);
                    mark(step, stage - 1, 1);
                }
                if (warp == WARPS - 1) layernorm_stats<C>(x_in, eps, ln_s);  // read after rows_dot's syncs
                linear_items<weight_t, C, THREADS>(LinearSlot<weight_t>(at, piece(sh, 0, stage_rows[0]), C, true, true), sh,
                                                   stage_rows[0], stage_items[0], true, in_s, red, take, release,
                                                   [&](const LinearSlot<weight_t>& it, int r, int n, float a) {
                    a = it.folded(r, a, ln_s);
                    ll_store(qkv_l + n, a, epoch);
                    if (n >= C) {  // for later steps (this one's stage B takes it from qkv)
                        const int hd = (n - C) % C;
                        weight_t* cache = n < 2 * C ? L.k_cache : L.v_cache;
                        store_as(cache + ((long long)(hd / HS) * max_len + pos) * HS + hd % HS, a);
                    }
                });
            }
            handoff(step);

            // B: this block's split of the keys: scores, their max and sum, and o = sum p_j v_j
            {
                const int chunk = (pos + 1 + splits - 1) / splits;
                const int k0 = min(pos + 1, split * chunk), n = head < NH ? min(pos + 1, k0 + chunk) - k0 : 0;
                const int staged = max(0, min(n, pos - k0));  // rows in the slot; the row at pos comes from qkv
                const bool has_new = n > staged;
                // q, and this step's key and value when this split holds pos (rounded to the cache's dtype,
                // as stage A stored them): word 0 q, 1 v (threads below HS), 2... k (warp 0)
                const unsigned long long* at_q = qkv_l + head * HS;
                unsigned long long w[2 + HS / 32];
                ll_gather(w, [&](int k) -> const unsigned long long* {
                    if (k == 0) return head < NH && tid < HS ? at_q + tid : nullptr;
                    if (k == 1) return has_new && tid < HS ? at_q + 2 * C + tid : nullptr;
                    return has_new && warp == 0 ? at_q + C + (k - 2) * 32 + lane : nullptr;
                }, epoch);
                if (head < NH && tid < HS) q_s[tid] = ll_float(w[0]);
                const float v_new = round_as<weight_t>(ll_float(w[1]));  // in threads below HS
                float k_new[HS / 32];
#pragma unroll
                for (int e = 0; e < HS / 32; ++e) k_new[e] = round_as<weight_t>(ll_float(w[2 + e]));  // in warp 0
                float* s_s = in_s;  // the scores; the new row's goes last
                compute_sync<THREADS>();
                mark(step, stage - 1, 1);
                // (waiting for the slot while q's first loads are out was no faster at 264: 143.8 against 143.9)
                ItemRows<weight_t, HS, decltype(take), decltype(release)> seq{take, release, stage_rows[1]};
                seq.next();
                if (has_new && warp == 0) {
                    float acc = 0.0f;
#pragma unroll
                    for (int e = 0; e < HS / 32; ++e) acc = fmaf(q_s[e * 32 + lane], k_new[e], acc);
                    acc = warp_sum(acc);
                    if (lane == 0) s_s[staged] = acc * scale;
                }
                // the staged keys, a thread each: its key's 16-byte vectors in an order rotated by the key, so
                // that the threads of a shared-memory phase (consecutive keys) read different banks (up to 8
                // threads a key, summed by shuffles, with the new key's score in the last warp, was 1.5 us
                // a token slower in bfloat16, H200; a warp a key, 4 keys at a time, each lane two of the
                // head's dimensions, with the softmax online in registers and no sync until the warps
                // combine, 5 us slower, 150.5 against 145.6 at 264, same run).
                // The split holding pos waits for k and v besides q, and was the last of its head to hand
                // over its partial in 98% of heads (0.3 us after the median split); every split adding
                // the key at pos itself as it combines, so that none waits for them here, was slower:
                // 148.5 against 143.9 in bfloat16, 209.7 against 204.3 in float32.
                constexpr int VEC = Vec16<weight_t>::N, KV = HS / VEC;
                seq.rows(0, staged, [&](const weight_t* K_s, int j0, int count) {
                    for (int i = tid; i < count; i += THREADS) {
                        const int j = j0 + i;
                        const uint4* key = reinterpret_cast<const uint4*>(K_s + (long long)i * HS);
                        float acc[2] = {0.0f, 0.0f};
#pragma unroll
                        for (int c0 = 0; c0 < KV; ++c0) {
                            const int c = (c0 + j) % KV;
                            float kv[VEC];
                            unpack(key[c], kv);
                            const float4* qv = reinterpret_cast<const float4*>(q_s + c * VEC);
#pragma unroll
                            for (int e = 0; e < VEC / 4; ++e) {
                                const float4 qe = qv[e];
                                float& a = acc[(c0 * (VEC / 4) + e) % 2];
                                a = fmaf(qe.x, kv[4 * e + 0], a);
                                a = fmaf(qe.y, kv[4 * e + 1], a);
                                a = fmaf(qe.z, kv[4 * e + 2], a);
                                a = fmaf(qe.w, kv[4 * e + 3], a);
                            }
                        }
                        s_s[j] = (acc[0] + acc[1]) * scale;
                    }
                });
                compute_sync<THREADS>();
                // warp 0: the scores' max m, p_j = e^(s_j - m) in place of s_j (once, for every thread's
                // o below), and their sum (every warp finding m itself, each thread then computing the
                // p_j of its keys, one sync less, was no faster)
                float m = -INFINITY, sum = 0.0f;
                if (warp == 0) {
                    for (int j = lane; j < n; j += 32) m = fmaxf(m, s_s[j]);
#pragma unroll
                    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
                    for (int j = lane; j < n; j += 32) {
                        const float p = expf(s_s[j] - m);
                        s_s[j] = p;
                        sum += p;
                    }
                    sum = warp_sum(sum);
                }
                compute_sync<THREADS>();
                constexpr int GROUPS = THREADS / HS;
                const int d = tid % HS, grp = tid / HS;
                float o = 0.0f;
                seq.rows(staged, 2 * staged, [&](const weight_t* V_s, int j0, int count) {
                    const float* p = s_s + (j0 - staged);
                    for (int j = grp; j < count; j += GROUPS) o = fmaf(p[j], to_float(V_s[j * HS + d]), o);
                });
                red[grp * HS + d] = o;
                compute_sync<THREADS>();
                // The head's splits hand their (o, m, l) to each other; each combines all of them in split
                // order, the same way: y_h = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s, M = max_s m_s.
                unsigned long long* part = ll_partial + ((long long)l * NH + head) * splits * (HS + 2);
                if (head < NH && tid < HS) {
                    float total = has_new ? s_s[staged] * v_new : 0.0f;  // v_new sits in threads below HS
                    for (int k = 0; k < GROUPS; ++k) total += red[k * HS + tid];
                    ll_store(part + split * (HS + 2) + tid, total, epoch);
                    if (tid == 0) { ll_store(part + split * (HS + 2) + HS, m, epoch); ll_store(part + split * (HS + 2) + HS + 1, sum, epoch); }
                }
                mark(step, stage, 2);
                if (head < NH) {
                    unsigned long long w[MAX_SPLITS + 2];  // o of each split (threads below HS), then m and l of split tid
                    ll_gather(w, [&](int k) -> const unsigned long long* {
                        if (k < MAX_SPLITS) return tid < HS && k < splits ? part + k * (HS + 2) + tid : nullptr;
                        return tid < splits ? part + tid * (HS + 2) + HS + (k - MAX_SPLITS) : nullptr;
                    }, epoch);
                    // (each warp of the first HS threads taking every split's m and l and handing them round by
                    // shuffles, one block sync less, was slower: bfloat16 147.9 against 146.6, float32 211.2
                    // against 205.6, H200, 264, same run)
                    if (tid < splits) { ml_s[2 * tid] = ll_float(w[MAX_SPLITS]); ml_s[2 * tid + 1] = ll_float(w[MAX_SPLITS + 1]); }
                    compute_sync<THREADS>();
                    mark(step, stage, 3);
                    if (tid < HS) {  // y_h, where q_h was
                        float M = -INFINITY;
#pragma unroll
                        for (int k = 0; k < MAX_SPLITS; ++k)
                            if (k < splits) M = fmaxf(M, ml_s[2 * k]);  // the loads go out together
                        float num = 0.0f, den = 0.0f;
#pragma unroll
                        for (int k = 0; k < MAX_SPLITS; ++k)
                            if (k < splits && ml_s[2 * k] != -INFINITY) {  // an empty split adds nothing
                                const float e = expf(ml_s[2 * k] - M);
                                num = fmaf(e, ll_float(w[k]), num);
                                den = fmaf(e, ml_s[2 * k + 1], den);
                            }
                        q_s[tid] = num / den;
                    }
                    compute_sync<THREADS>();
                    mark(step, stage, 4);
                    // attn.c_proj is a sum over heads: x += sum_h y_h W_proj[h] + b. This split's rows of
                    // the head's term, from the head-major copy W_proj[h] (C, HS) that came with the keys.
                    const Share proj = share(C, split, splits);
                    auto project = [&]() {
                        seq.rows(2 * staged, 2 * staged + proj.count, [&](const weight_t* W_s, int j0, int count) {
                            head_rows_dot<weight_t, HS, THREADS>(W_s, q_s, Share{proj.first + j0 - 2 * staged, count},
                                                                 proj_l + (long long)head * C, epoch);
                        });
                    };
                    project();
                    if (TRACE_MARKS >= 6 && stage_items[1] == 1) {  // the diagnostic's second pass, the same stores
                        compute_sync<THREADS>();
                        mark(step, stage, 5);
                        project();
                    }
                }
                while (seq.taken < stage_items[1]) seq.next();  // the rest are empty: every block takes as many
            }
            handoff(step);
            if (REDUCE_HEADS)  // x after the attention, this block's columns of it (its wait is stage B's)
                reduce_heads<C, NH, THREADS>(x_in, proj_l, epoch, L.b_proj, in_s, pw_xa + (long long)l * C);

            // C: x += sum_h proj_h + b (the heads in order); g = gelu(LN_2(x) W_fc + b), LayerNorm folded
            sh = share(F, b, G);
            {
                const unsigned char* at = take();
                if (REDUCE_HEADS)
                    pw_input<C, THREADS>(pw_xa + (long long)l * C, epoch, x_in, nullptr, in_s, linear_ln_w(at));
                else
                    proj_input<C, NH, THREADS>(x_in, proj_l, epoch, L.b_proj, x_in, in_s, linear_ln_w(at));
                mark(step, stage - 1, 1);
                if (warp == WARPS - 1) layernorm_stats<C>(x_in, eps, ln_s);
                linear_items<weight_t, C, THREADS>(LinearSlot<weight_t>(at, piece(sh, 0, stage_rows[2]), C, true, true), sh,
                                                   stage_rows[2], stage_items[2], true, in_s, red, take, release,
                                                   [&](const LinearSlot<weight_t>& it, int r, int n, float a) {
                    pw_store(pw_g + (long long)l * F + n, gelu_tanh(it.folded(r, a, ln_s)), epoch);
                });
            }
            handoff(step);

            // D: x += g W_mlp + b
            sh = share(C, b, G);
            {
                pw_input<F, THREADS>(pw_g + (long long)l * F, epoch, in_s, nullptr);
                mark(step, stage - 1, 1);
                linear_items<weight_t, F, THREADS>(LinearSlot<weight_t>(take(), piece(sh, 0, stage_rows[3]), F, false, true), sh,
                                                   stage_rows[3], stage_items[3], false, in_s, red, take, release,
                                                   [&](const LinearSlot<weight_t>& it, int r, int n, float a) {
                    pw_store(pw_x + (long long)l * C + n, x_in[n] + (a + it.bias[r]), epoch);
                });
            }
            handoff(step);
        }

        // E: the logits of this block's rows of wte, LN_f folded in as in stages A and C: first the rows it
        // keeps in shared memory, then the rest chunk by chunk; the block's (max, argmax). Block 0 keeps
        // the final x.
        const KeptRows<weight_t, C> keep(kept, lm_keep, share(V, b, G).first);
        if (step == 0) mbar_wait(&kept_bar, 0);
        pw_input<C, THREADS>(pw_x + (long long)(n_layer - 1) * C, epoch, x_in, b == 0 ? x : nullptr, in_s, keep.ln_w);
        mark(step, stage - 1, 1);
        if (warp == WARPS - 1) layernorm_stats<C>(x_in, eps, ln_s);  // read after rows_dot's syncs
        const Share lm = share(V, b, G);
        float best = -INFINITY;
        int arg = 0x7fffffff;
        for (int c = lm_keep > 0 ? -1 : 0; c < lm_chunks; ++c) {  // c = -1: the kept rows
            const int n0 = lm.first + (c < 0 ? 0 : lm_keep + c * lm_rows);
            const int R = c < 0 ? max(0, min(lm_keep, lm.count)) : max(0, min(lm_rows, lm.count - lm_keep - c * lm_rows));
            const LmRows<weight_t, C> rows = c < 0 ? LmRows<weight_t, C>(keep) : LmRows<weight_t, C>(take(), R, n0);
            const float v = rows_dot<weight_t, C, THREADS>(rows.W, in_s, R, red);
            if (tid < R) {
                const float logit = rows.folded(tid, v, ln_s);
                if (logits != nullptr) logits[n0 + tid] = logit;
                take_max(best, arg, logit, n0 + tid);
            }
            if (c >= 0 && c + 1 < lm_chunks) release();
        }
        // the block's best (rows_dot's values sit in threads below R: warps reduce, then thread 0)
        warp_argmax(best, arg);
        if (lane == 0) { red[warp] = best; reinterpret_cast<int*>(scratch)[warp] = arg; }
        compute_sync<THREADS>();
        if (tid == 0) {
            for (int w = 1; w < WARPS; ++w) take_max(red[0], reinterpret_cast<int*>(scratch)[0], red[w], reinterpret_cast<int*>(scratch)[w]);
            block_max[b] = red[0];
            block_arg[b] = reinterpret_cast<int*>(scratch)[0];
            // the next step's embedding into L2: the block's candidate row of wte (a kept row is not read
            // through L2 in the step) and the row of wpe. With the embedding's 16-byte loads (stage A of
            // layer 0) the step was 1.2 us a token faster in bfloat16 and 1.0 in float32 (H200, position
            // 264, same run); the loads alone gained 1.0 and 1.2, so the prefetch's part is within noise
            // there (at 519 in bfloat16: 0.8 of 0.9)
            const int cand = reinterpret_cast<int*>(scratch)[0];
            if (cand >= 0 && cand < V) l2_prefetch(wte + (long long)cand * C, C * (unsigned int)sizeof(weight_t));
            if (pos + 1 < max_len) l2_prefetch(wpe + (long long)(pos + 1) * C, C * (unsigned int)sizeof(weight_t));
        }
        finish(step);
        if (tid == 0) mbar_arrive(&stepped);  // the producer may now issue the next step's stage B items

        // Every block reduces the blocks' maxima (in the same order): the next token, known everywhere.
        if (warp == 0) {
            best = -INFINITY;
            arg = 0x7fffffff;
            for (int k = lane; k < G; k += 32) take_max(best, arg, fresh(block_max + k), fresh(block_arg + k));
            warp_argmax(best, arg);
            if (lane == 0) arg_s = (arg >= 0 && arg < V) ? arg : 0;
        }
        compute_sync<THREADS>();
        token = arg_s;
        if (b == 0 && tid == 0) {
            history[pos + 1] = token;
            state[0] = token;
            state[1] = pos + 1;
        }
    }
    if (b == 0 && tid == 0) *ll_epoch = epoch0 + steps;  // every block read it before the first step's last barrier
}
