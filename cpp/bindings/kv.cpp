// nanobind only: the paged-KV bindings (PagePool, gather/scatter over storage).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "mlx_infer/kv.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
using mlx_infer::AppendResult;
using mlx_infer::PageGroups;
using mlx_infer::PagePool;
using mlx_infer::StepPlan;

void bind_kv(nb::module_& m) {
  nb::class_<AppendResult>(
      m, "AppendResult",
      R"(What ``PagePool.append`` asks of the caller, in this order:

1. for each ``(src, dst)`` in ``copies``: copy page ``src`` to page ``dst`` on
   every layer's K/V storage (copy-on-write of a shared last page);
2. write the new tokens' K/V at the flat ``slots`` (``page * page_size +
   offset``), one per appended token, in token order.)")
      .def_ro("slots", &AppendResult::slots,
              "Flat write slot of each appended token (list[int]).")
      .def_ro("copies", &AppendResult::copies,
              "Page copies ``(src_page, dst_page)`` to perform before writing.")
      .def_prop_ro("writes", &AppendResult::writes,
                   "The slots as ``(page, offset)`` pairs (list[tuple[int, int]]).")
      .def("__repr__", [](const AppendResult& r) {
        return "AppendResult(slots=" + std::to_string(r.slots.size()) +
               " tokens, copies=" + std::to_string(r.copies.size()) + ")";
      });

  nb::class_<PagePool>(
      m, "PagePool",
      R"(A fixed pool of KV pages: block tables, refcounts, copy-on-write
forks, sliding-window release and a prefix index of full pages.

Page 0 is the reserved null page: never handed out, it keeps gathers through
released (windowed-out) block-table entries in bounds. Running out of pages
is a return value (``append`` returns ``None`` and changes nothing); bad input
raises ``ValueError``. Not thread-safe.

Page states: *free* (refcount 0, no hash, FIFO queue), *cached* (refcount 0,
hashed, evictable in LRU order, a freed sequence's tail evicted before its
head), *used* (refcount > 0). Allocation takes a free page first, then evicts
the least recently used cached page.

Capacity and materialization: ``num_pages`` is the capacity (what admission
treats as the limit); only ids below ``materialized`` (pages whose storage
exists) are handed out, and ``grow(to)`` makes more available. Ids never
change and the pool never shrinks, so block tables stay valid.)")
      .def(
          "__init__",
          [](PagePool* self, int num_pages, int page_size, std::optional<int> materialized) {
            new (self) PagePool(num_pages, page_size, materialized.value_or(-1));
          },
          nb::kw_only(), "num_pages"_a, "page_size"_a, "materialized"_a = nb::none(),
          R"(Args:
    num_pages: the capacity, null page included (>= 2).
    page_size: tokens per page, a positive power of two.
    materialized: pages handed out at first, null page included, in
        ``[2, num_pages]``; ``None``: all of them.)")
      .def_prop_ro("num_pages", &PagePool::num_pages,
                   "The capacity: most pages the pool can hold, null page included.")
      .def_prop_ro("page_size", &PagePool::page_size, "Tokens per page.")
      .def_prop_ro("materialized", &PagePool::materialized,
                   "Pages whose ids can be handed out now, null page included (ids ``[0, materialized)``).")
      .def("num_unmaterialized_pages", &PagePool::num_unmaterialized_pages,
           "Pages of the capacity not materialized yet (``num_pages - materialized``).")
      .def("grow", &PagePool::grow, "to"_a,
           R"(Makes ids ``[materialized, to)`` free (the back of the free queue);
grow the storage to ``to`` pages first. Returns the number of pages added.

Raises:
    ValueError: ``to`` is below ``materialized`` (the pool never shrinks) or
        above ``num_pages``.)")
      .def_prop_ro("cache_cap", &PagePool::cache_cap,
                   "Most cached (refcount 0, hashed) pages kept; see set_cache_cap.")
      .def_prop_ro("hits", &PagePool::hits,
                   "Pages reused by add_sequence_with_prefix.")
      .def_prop_ro("misses", &PagePool::misses,
                   "Full prompt pages add_sequence_with_prefix could not reuse.")
      .def_prop_ro("evictions", &PagePool::evictions,
                   "Cached pages dropped from the prefix index (LRU or cap).")
      .def("add_sequence", &PagePool::add_sequence, "seq_id"_a, nb::kw_only(),
           "namespace"_a = "",
           R"(Adds an empty sequence. ``namespace`` separates prefix-cache
entries (e.g. per model or adapter); raises ValueError if the id exists.)")
      .def("add_sequence_with_prefix", &PagePool::add_sequence_with_prefix,
           "seq_id"_a, "token_ids"_a, nb::kw_only(), "namespace"_a = "",
           R"(Adds a sequence starting with the longest cached chain of full
pages prefixing ``token_ids`` (refcount +1 each; cached pages stop being
evictable), always leaving at least one token to compute.

Returns:
    The number of cached tokens (a multiple of page_size); the caller then
    ``append``s the remaining ``len(token_ids) - n`` tokens.)")
      .def("append", &PagePool::append, "seq_id"_a, "n_tokens"_a,
           R"(Reserves slots for ``n_tokens`` more tokens.

Returns:
    An ``AppendResult`` (copies to perform, then slots to write), or ``None``
    when the pool has too few pages; the pool is then unchanged.)")
      .def("fork", &PagePool::fork, "src"_a, "dst"_a,
           "Creates ``dst`` sharing all of ``src``'s pages (refcount +1 each).")
      .def("free", &PagePool::free, "seq_id"_a,
           "Releases the sequence; hashed pages stay cached until evicted.")
      .def("truncate", &PagePool::truncate, "seq_id"_a, "n_tokens"_a,
           "Drops the last ``n_tokens`` tokens (rollback), releasing emptied pages.")
      .def("release_outside_window", &PagePool::release_outside_window,
           "seq_id"_a, "window"_a,
           R"(Releases pages wholly before the last ``window`` tokens; their
block-table entries become 0 (the null page). Returns the number released.
A later ``truncate`` must not end the sequence inside a released page.)")
      .def("has_sequence", &PagePool::has_sequence, "seq_id"_a)
      .def("sequences", &PagePool::sequences, "Live sequence ids, sorted.")
      .def("block_table", &PagePool::block_table, "seq_id"_a,
           "Physical page of each logical page (0 = released by a window).")
      .def("length", &PagePool::length, "seq_id"_a, "Tokens in the sequence.")
      .def("num_free_pages", &PagePool::num_free_pages,
           "Pages ``append`` can still hand out: free plus evictable cached (materialized ones only).")
      .def("num_cached_pages", &PagePool::num_cached_pages,
           "Pages with refcount 0 that carry a prefix hash (evictable).")
      .def("num_used_pages", &PagePool::num_used_pages, "Pages with refcount > 0.")
      .def("refcount", &PagePool::refcount, "page"_a,
           "Block tables holding ``page`` (0 for the null page).")
      .def("page_hash", &PagePool::page_hash, "page"_a,
           "The page's prefix-chain hash, or None when it is not indexed.")
      .def("cached_pages", &PagePool::cached_pages,
           "Cached pages in eviction order (next evicted first).")
      .def("register_full_pages", &PagePool::register_full_pages, "seq_id"_a,
           "token_ids"_a,
           R"(Indexes the sequence's full pages covered by ``token_ids`` (its
tokens from position 0; only the first ``min(len(token_ids), length)`` count)
under the sequence's namespace. Returns how many pages were newly indexed.)")
      .def("match_prefix", &PagePool::match_prefix, "token_ids"_a, nb::kw_only(),
           "namespace"_a = "",
           "Pages of the longest cached chain prefixing ``token_ids``; no side effects.")
      .def("pages_needed", &PagePool::pages_needed, "seq_id"_a, "n_tokens"_a,
           "Pages ``append(seq_id, n_tokens)`` would take now (copy-on-write included).")
      .def("first_held_token", &PagePool::first_held_token, "seq_id"_a,
           "First token whose page is still held (earlier ones were released by a window).")
      .def("prefix_hits", &PagePool::prefix_hits, "token_ids"_a, nb::kw_only(),
           "namespace"_a = "", "max_pages"_a = static_cast<size_t>(1) << 62,
           R"(For each full page of ``token_ids``: the indexed page holding that
page of the chain, or 0 where it is not indexed (does not stop at a miss).
No side effects.)")
      .def("set_cache_cap", &PagePool::set_cache_cap, "pages"_a,
           "Keeps at most ``pages`` cached pages, evicting LRU pages over it now.")
      .def("check", &PagePool::check,
           "Verifies every internal invariant; raises RuntimeError naming a broken one.")
      .def("__repr__", [](const PagePool& p) {
        return "PagePool(num_pages=" + std::to_string(p.num_pages()) +
               ", materialized=" + std::to_string(p.materialized()) +
               ", page_size=" + std::to_string(p.page_size()) +
               ", free=" + std::to_string(p.num_free_pages()) +
               ", cached=" + std::to_string(p.num_cached_pages()) +
               ", used=" + std::to_string(p.num_used_pages()) + ")";
      });

  nb::class_<StepPlan>(
      m, "StepPlan",
      R"(One step of a batch as int32 arrays (``PageGroups.append_batch``): R
rows, one new token each; a sequence given n tokens has n consecutive rows
with the same block table and consecutive positions (a prefill chunk).
Row r attends keys ``[max(0, lengths[r] - window), lengths[r])`` of its
group, its own new key included (all rows are written before attention).
Per group g, first copy pages ``copy_src[g][i] -> copy_dst[g][i]`` on every
layer of the group (copy-on-write), then write row r's K/V at
``write_slots[g][r]`` (``page * page_size + offset``).)")
      .def_ro("positions", &StepPlan::positions, "(R,) position of each row's token.")
      .def_ro("lengths", &StepPlan::lengths, "(R,) positions + 1: keys each row may read.")
      .def_ro("call_ends", &StepPlan::call_ends,
              "(R,) start + count of each row's sequence: the end of the row's call, the same for every row "
              "of a chunk (LongRoPE's table; padding rows 1).")
      .def_ro("block_tables", &StepPlan::block_tables,
              "Per group, (R, T) page ids (0 = null page padding; T a multiple of table_bucket).")
      .def_ro("write_slots", &StepPlan::write_slots, "Per group, (R,) flat slot of each row's new K/V.")
      .def_ro("copy_src", &StepPlan::copy_src, "Per group, (c,) pages to copy from (c may be 0).")
      .def_ro("copy_dst", &StepPlan::copy_dst, "Per group, (c,) pages to copy to.")
      .def_ro("num_copies", &StepPlan::num_copies, "Per group, the number of page copies.")
      .def_ro("rows", &StepPlan::rows, "R, the rows of the step (padding rows included).")
      .def_ro("real_rows", &StepPlan::real_rows, "sum(counts): the rows before padding (they come first).")
      .def_ro("min_length", &StepPlan::min_length, "Smallest of lengths (known without a sync).")
      .def_ro("max_length", &StepPlan::max_length, "Largest of lengths.")
      .def("gather_index", &StepPlan::gather_index, "group"_a, "window"_a, "bucket"_a = 1,
           R"(The gather index of one window kind over group ``group`` (``window``
0 = global), built on the host: ``(pages, offsets, valid)``, each ``(R, S)``
(int32, int32, bool). Key s of row r sits at ``(pages, offsets)[r, s]``
where ``valid[r, s]``; padding points at slot 0 of the null page. S is the
longest row's key count rounded up to a multiple of ``bucket``.)")
      .def("__repr__", [](const StepPlan& p) {
        return "StepPlan(rows=" + std::to_string(p.rows) + ", lengths " + std::to_string(p.min_length) +
               ".." + std::to_string(p.max_length) + ")";
      });

  nb::class_<PageGroups>(
      m, "PageGroups",
      R"(One ``PagePool`` per layer group (global, or one sliding window), each
with its own block tables: a windowed group releases the pages behind its
window while the global group keeps every page (vLLM's hybrid KV manager).

A group of window ``w`` keeps the last ``w - 1 + slack`` tokens; ``slack``
is how far a caller may roll back (``truncate``) beyond the last append.
Every sequence lives in every group with the same length. ``append`` is all
groups or none (``None`` when any group is out of pages); a prefix hit needs
every group to hit: the global group all its pages, a windowed group only
the pages of its window before the hit's end. Bad input raises
``ValueError``. Not thread-safe.)")
      .def(nb::init<const std::vector<int>&, int, const std::vector<int64_t>&, int64_t, const std::vector<int>&>(),
           nb::kw_only(), "num_pages"_a, "page_size"_a, "windows"_a, "slack"_a,
           "materialized"_a = std::vector<int>{},
           R"(Args:
    num_pages: each group's capacity, null page included (each >= 2).
    page_size: tokens per page, a positive power of two.
    windows: sliding window of each group in tokens, 0 for global.
    slack: tokens a windowed group keeps beyond its window, for rollback.
    materialized: pages each group hands out at first (see ``PagePool``);
        empty: all of them.)")
      .def_prop_ro("num_groups", &PageGroups::num_groups)
      .def_prop_ro("page_size", &PageGroups::page_size, "Tokens per page.")
      .def_prop_ro("slack", &PageGroups::slack, "Tokens kept beyond each window.")
      .def_prop_ro("hits", &PageGroups::hits,
                   "Pages reused by add_sequence_with_prefix (all groups hit).")
      .def_prop_ro("misses", &PageGroups::misses,
                   "Full prompt pages add_sequence_with_prefix could not reuse.")
      .def("pool", nb::overload_cast<int>(&PageGroups::pool), "group"_a,
           nb::rv_policy::reference_internal,
           "The group's ``PagePool`` (inspect it; mutate sequences through PageGroups).")
      .def("window", &PageGroups::window, "group"_a, "The group's window (0 = global).")
      .def("keep", &PageGroups::keep, "group"_a,
           "Tokens behind the end the group keeps (0 = all).")
      .def("add_sequence", &PageGroups::add_sequence, "seq_id"_a, nb::kw_only(),
           "namespace"_a = "", "Adds an empty sequence to every group.")
      .def("add_sequence_with_prefix", &PageGroups::add_sequence_with_prefix,
           "seq_id"_a, "token_ids"_a, nb::kw_only(), "namespace"_a = "",
           R"(Adds a sequence starting with the longest cached prefix of
``token_ids`` that every group can serve (whole pages, at least one token
left to compute). Returns the number of cached tokens.)")
      .def("match_prefix", &PageGroups::match_prefix, "token_ids"_a, nb::kw_only(),
           "namespace"_a = "",
           "Tokens ``add_sequence_with_prefix`` would reuse now; no side effects.")
      .def("append", &PageGroups::append, "seq_id"_a, "n_tokens"_a,
           R"(Releases each windowed group's pages behind its window, then
reserves ``n_tokens`` in every group.

Returns:
    One ``AppendResult`` per group, or ``None`` when some group has too few
    pages (nothing is appended).)")
      .def("append_batch", &PageGroups::append_batch, "seq_ids"_a, "counts"_a, nb::kw_only(),
           "table_bucket"_a = 1, "row_bucket"_a = 1,
           R"(Appends ``counts[i]`` tokens to sequence ``seq_ids[i]`` for every i,
all or nothing: one call per batched step.

Args:
    seq_ids: distinct live sequence ids, in row order.
    counts: tokens each gets (>= 1; 1 for a decode row, n for a prefill chunk).
    table_bucket: round the block tables' width T up to a multiple of this.
    row_bucket: round R up to a multiple of this with padding rows after the
        real ones (position 0, length 1, an all-null table, written at slot 0
        of the null page, which only padding reads), so the compiled step
        sees few distinct R.

Returns:
    The step's ``StepPlan``, or ``None`` when some group has too few pages
    (no sequence grew; window releases may have happened).)")
      .def("pages_needed", &PageGroups::pages_needed, "seq_ids"_a, "counts"_a,
           R"(Pages each group needs to append ``counts[i]`` tokens to
``seq_ids[i]`` for every i now: new pages plus copy-on-write copies, summed
per group. No window release happens here, so after a failed ``append`` /
``append_batch`` (which released) it is exact. Pure.)")
      .def("grow", &PageGroups::grow, "group"_a, "to"_a,
           "``PagePool.grow`` on one group; returns the pages added.")
      .def("fork", &PageGroups::fork, "src"_a, "dst"_a,
           "Creates ``dst`` sharing all of ``src``'s held pages, in every group.")
      .def("free", &PageGroups::free, "seq_id"_a, "Releases the sequence in every group.")
      .def("truncate", &PageGroups::truncate, "seq_id"_a, "n_tokens"_a,
           R"(Drops the last ``n_tokens`` tokens in every group. Raises
ValueError (changing nothing) when a windowed group would then read a token
it already released: roll back at most ``slack`` tokens past the last append.)")
      .def("register_full_pages", &PageGroups::register_full_pages, "seq_id"_a,
           "token_ids"_a,
           "Indexes the held full pages in every group; returns pages newly indexed (sum).")
      .def("has_sequence", &PageGroups::has_sequence, "seq_id"_a)
      .def("sequences", &PageGroups::sequences, "Live sequence ids, sorted.")
      .def("length", &PageGroups::length, "seq_id"_a, "Tokens in the sequence.")
      .def("block_table", &PageGroups::block_table, "seq_id"_a, "group"_a,
           "The sequence's block table in ``group`` (0 = released by the window).")
      .def("held_pages", &PageGroups::held_pages, "seq_id"_a, "group"_a,
           "Pages of ``group`` the sequence holds (non-null entries).")
      .def("check", &PageGroups::check,
           "Verifies every pool and the groups' agreement; raises RuntimeError.")
      .def("__repr__", [](const PageGroups& g) {
        std::string out = "PageGroups(";
        for (int i = 0; i < g.num_groups(); ++i) {
          const PagePool& p = g.pool(i);
          out += (i ? ", " : "") + std::string("window ") + std::to_string(g.window(i)) +
                 ": used " + std::to_string(p.num_used_pages()) + "/" +
                 std::to_string(p.num_pages() - 1);
        }
        return out + ")";
      });

  m.def("prefetch_to_gpu", &mlx_infer::prefetch_to_gpu, "array"_a,
        R"(Start moving an evaluated host-made array's pages to the GPU (CUDA only; a hint).

MLX's CUDA allocator keeps an array made from host data in managed memory; the first kernel
that reads it faults its pages over. The engine's step plan is prefetched this way when it is
made. Returns ``False`` (doing nothing) off CUDA, with ``MLX_INFER_PREFETCH_PLAN=0``, or after a
failed prefetch (``prefetch_error()`` says why); ``True`` when a prefetch was issued.)");
  m.def("prefetch_error", &mlx_infer::prefetch_error,
        "Why prefetch_to_gpu stopped prefetching ('' when it has not failed).");

  m.def(
      "gather_pages",
      [](const mx::array& storage, const mx::array& block_table, int length) {
        return mlx_infer::gather_pages(storage, block_table, length);
      },
      "storage"_a, "block_table"_a, nb::kw_only(), "length"_a,
      R"(One sequence's K or V, contiguous, from paged storage.

Args:
    storage: ``(pages, kv_heads, page_size, head_dim)``.
    block_table: ``(max_pages,)`` integer page ids; the first
        ``ceil(length / page_size)`` are read.
    length: tokens to return.

Returns:
    ``(kv_heads, length, head_dim)`` in storage's dtype.)");

  m.def(
      "scatter_slots",
      [](const mx::array& storage, const mx::array& slots, const mx::array& values) {
        return mlx_infer::scatter_slots(storage, slots, values);
      },
      "storage"_a, "slots"_a, "values"_a,
      R"(``storage`` with ``values`` written at flat ``slots``; the input array
is not modified (MLX arrays are values).

Args:
    storage: ``(pages, kv_heads, page_size, head_dim)``.
    slots: ``(T,)`` distinct integer flat slots ``page * page_size + offset``,
        each < ``pages * page_size`` (not checked: that would force evaluation).
    values: ``(kv_heads, T, head_dim)``, cast to storage's dtype.

Returns:
    The updated storage array.)");
}
