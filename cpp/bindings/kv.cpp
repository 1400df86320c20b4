// nanobind only: the paged-KV bindings (PagePool, gather/scatter over storage).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "mlx_infer/kv.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
using mlx_infer::AppendResult;
using mlx_infer::PagePool;

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
the least recently used cached page.)")
      .def(nb::init<int, int>(), nb::kw_only(), "num_pages"_a, "page_size"_a,
           R"(Args:
    num_pages: total pages including the null page (>= 2).
    page_size: tokens per page, a positive power of two.)")
      .def_prop_ro("num_pages", &PagePool::num_pages, "Total pages, null page included.")
      .def_prop_ro("page_size", &PagePool::page_size, "Tokens per page.")
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
           "Pages ``append`` can still hand out: free plus evictable cached.")
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
      .def("set_cache_cap", &PagePool::set_cache_cap, "pages"_a,
           "Keeps at most ``pages`` cached pages, evicting LRU pages over it now.")
      .def("check", &PagePool::check,
           "Verifies every internal invariant; raises RuntimeError naming a broken one.")
      .def("__repr__", [](const PagePool& p) {
        return "PagePool(num_pages=" + std::to_string(p.num_pages()) +
               ", page_size=" + std::to_string(p.page_size()) +
               ", free=" + std::to_string(p.num_free_pages()) +
               ", cached=" + std::to_string(p.num_cached_pages()) +
               ", used=" + std::to_string(p.num_used_pages()) + ")";
      });

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
