// Paged KV cache: the page pool, per-sequence block tables, the prefix index
// and the index math over paged K/V storage (see DESIGN.md, conventions 3-5).
//
//   sequence 7: tokens 0..37, page_size 16
//
//     block table   [ 4 ][ 9 ][ 2 ]          logical page i -> physical page
//                     |    |    |
//     storage       [pages, kv_heads, page_size, head_dim]   (one per layer)
//                     page 0: the null page, never handed out
//                     page 4: tokens  0..15 of seq 7
//                     page 9: tokens 16..31 of seq 7
//                     page 2: tokens 32..37 of seq 7 (6 of 16 slots used)
//
//   flat slot of token t = block_table[t / page_size] * page_size + t % page_size
//
// The pool only does bookkeeping; K/V values live in MLX arrays the Python
// adapter owns. Every mutation the caller must mirror on that storage (slot
// writes, page copies) is returned explicitly.
#pragma once

#include <cstdint>
#include <deque>
#include <list>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <mlx/mlx.h>

namespace mlx_infer {

namespace mx = mlx::core;

/// Flat write slots for tokens at `positions` of sequences whose pages are
/// listed in `block_tables`.
///
///   block_tables (B, max_pages) int32: page ids, row b for sequence b
///   positions    (B, L)         int32: token positions within each sequence
///   returns      (B, L)         int32: page_id * page_size + position % page_size
///
/// A position past the end of its block table is a caller bug and raises.
mx::array slot_mapping(
    const mx::array& block_tables,
    const mx::array& positions,
    int page_size,
    mx::StreamOrDevice s = {});

/// The K/V of one sequence, contiguous, from paged storage.
///
///   storage     (pages, kv_heads, page_size, head_dim)
///   block_table (max_pages,) integer page ids; the first
///               ceil(length / page_size) are read
///   returns     (kv_heads, length, head_dim)
///
/// Only the sequence's pages are gathered (never a transpose of the whole
/// pool). Null-page entries (released by a sliding window) read page 0.
mx::array gather_pages(
    const mx::array& storage,
    const mx::array& block_table,
    int length,
    mx::StreamOrDevice s = {});

/// `storage` with `values` written at flat `slots`; MLX arrays are values, so
/// the updated storage is returned and the input is untouched.
///
///   storage (pages, kv_heads, page_size, head_dim)
///   slots   (T,) integer flat slots (page * page_size + offset)
///   values  (kv_heads, T, head_dim), cast to storage's dtype
///
/// Slots must be distinct and < pages * page_size: which of two writes to one
/// slot wins is unspecified, and out-of-range slots are not checked (that
/// would force an evaluation).
mx::array scatter_slots(
    const mx::array& storage,
    const mx::array& slots,
    const mx::array& values,
    mx::StreamOrDevice s = {});

/// What `PagePool::append` asks of the caller, in order: first copy every
/// `(src, dst)` page of `copies` on each layer's K/V storage, then write the
/// new tokens' K/V at `slots` (flat, `page * page_size + offset`).
struct AppendResult {
  std::vector<int64_t> slots;
  std::vector<std::pair<int32_t, int32_t>> copies;
  int page_size = 0;

  /// The slots as (page, offset within the page).
  std::vector<std::pair<int32_t, int32_t>> writes() const {
    std::vector<std::pair<int32_t, int32_t>> out;
    out.reserve(slots.size());
    for (int64_t slot : slots) {
      out.emplace_back(static_cast<int32_t>(slot / page_size),
                       static_cast<int32_t>(slot % page_size));
    }
    return out;
  }
};

/// On CUDA, start moving a host-made array's managed pages to the GPU on a stream of
/// its own (cuMemPrefetchAsync), so the step's first kernel does not fault them in.
/// A hint: returns false (and does nothing) without a CUDA driver, with
/// MLX_INFER_PREFETCH_PLAN=0, or after a failure (prefetch_error() says which).
bool prefetch_to_gpu(const mx::array& a);
std::string prefetch_error();

/// One step of a batch, as arrays: what every paged forward reads (the eager
/// paged graph and the compiled paged step alike). R rows, one new token
/// each; a sequence given n tokens gets n consecutive rows with the same
/// block table and consecutive positions (a prefill chunk):
///
///   seqs 4 (len 37 -> +1), 9 (len 3 -> +2), page_size 16
///
///   row  seq  position  length  call_end  block_tables[g] (T = 3)  write_slots[g]
///   0    4    37        38      38        [ 7  2  5 ]             5*16 + 5
///   1    9    3         4       5         [ 8  0  0 ]             8*16 + 3
///   2    9    4         5       5         [ 8  0  0 ]             8*16 + 4
///
/// call_ends is one past the last position of each row's call, the same for
/// every row of a chunk: what the eager graph would see running the chunk as
/// one call (LongRoPE picks its table by it).
/// A row attends keys [max(0, length - window), length) of its group: its
/// own new key included, so every row's K/V is written before attention and
/// the rows of a chunk see each other causally. Padding entries are 0, the
/// null page. Before writing, copy page copy_src[g][i] -> copy_dst[g][i]
/// (copy-on-write of a shared last page) on every layer of group g.
struct StepPlan {
  mx::array positions;                  // (R,) int32
  mx::array lengths;                    // (R,) int32, position + 1
  mx::array call_ends;                  // (R,) int32, the row's sequence's start + count (padding: 1)
  std::vector<mx::array> block_tables;  // per group (R, T) int32, T a multiple of table_bucket
  std::vector<mx::array> write_slots;   // per group (R,) int32, page * page_size + offset
  std::vector<mx::array> copy_src;      // per group (c_g,) int32 (c_g may be 0)
  std::vector<mx::array> copy_dst;      // per group (c_g,) int32
  std::vector<int> num_copies;          // per group c_g
  int rows = 0;       // R, padding rows included
  int real_rows = 0;  // sum(counts): the rows before padding
  int min_length = 0;  // smallest and largest length: the host knows S without a sync
  int max_length = 0;

  /// The gather index of one window kind (0 = global) over group `group`:
  /// token s of row r's keys sits at (pages, offsets)[r, s]; valid[r, s]
  /// says whether it is one (padding: slot 0 of the null page). S is the
  /// longest row's key count rounded up to a multiple of `bucket`.
  ///   returns pages (R, S) int32, offsets (R, S) int32, valid (R, S) bool
  std::tuple<mx::array, mx::array, mx::array> gather_index(int group, int64_t window, int bucket) const;

  // Host copies the gather index is built from (not exposed).
  int page_size = 0;
  int table_width = 0;
  std::vector<int32_t> host_lengths;               // (R,)
  std::vector<std::vector<int32_t>> host_tables;   // per group (R * T)
};

/// A fixed pool of KV pages with per-sequence block tables, refcounts,
/// copy-on-write forks, sliding-window release and a content-addressed
/// prefix index.
///
/// Page states (page 0, the null page, is in none of them):
///
///   free      refcount 0, no hash   -> free queue (FIFO)
///   cached    refcount 0, hashed    -> evictable LRU (front evicted first)
///   used      refcount > 0          -> in >= 1 block table (hashed or not)
///
///   allocate: free queue front, else evict the cached LRU front
///   release:  refcount hits 0 -> cached LRU back if hashed, else free queue back
///   reuse:    a prefix match pulls a cached page out of the LRU (refcount 1)
///
/// A page is written in place only by its sole owner; a shared partially
/// filled last page is copied first (copy-on-write). A hashed page is
/// immutable while shared; its sole owner writing into it drops the hash.
///
/// Capacity and materialized pages: the pool may hold up to `num_pages`
/// (its capacity, what admission treats as the limit) but hands out only ids
/// below `materialized()`, the pages whose storage exists. `grow(to)` makes
/// ids [materialized, to) free (appended to the free queue); ids never change
/// and the pool never shrinks, so block tables stay valid across growth:
///
///   capacity 12, materialized 6    ids 1..5 usable, 6..11 not handed out
///   grow(9)                        ids 6..8 join the free queue (storage grown first)
///
/// Running out of pages is a return value (`append` -> nullopt, nothing
/// changed); bad input throws std::invalid_argument. Not thread-safe.
class PagePool {
 public:
  /// `materialized` < 0: all `num_pages` (no growth needed).
  PagePool(int num_pages, int page_size, int materialized = -1);

  /// The capacity: most pages the pool can ever hold, null page included.
  int num_pages() const { return static_cast<int>(refcount_.size()); }
  int page_size() const { return page_size_; }
  /// Pages whose ids can be handed out now (null page included): [0, materialized).
  int materialized() const { return materialized_; }
  /// Pages of the capacity not materialized yet.
  int num_unmaterialized_pages() const { return num_pages() - materialized_; }
  /// Makes ids [materialized, to) available (free); `to` in [materialized, num_pages].
  /// Returns how many pages were added. The caller grows the storage first.
  int grow(int to);

  // -- sequences -----------------------------------------------------------
  void add_sequence(int64_t seq_id, const std::string& ns = "");
  /// Adds a sequence that starts with the longest cached prefix of
  /// `token_ids` (whole pages only, leaving at least one token to compute so
  /// the caller gets logits); returns the number of cached tokens.
  int64_t add_sequence_with_prefix(
      int64_t seq_id,
      const std::vector<int32_t>& token_ids,
      const std::string& ns = "");
  /// Reserves slots for `n_tokens` more tokens; nullopt (and no change) when
  /// the pool has too few pages.
  std::optional<AppendResult> append(int64_t seq_id, int64_t n_tokens);
  void fork(int64_t src, int64_t dst);
  void free(int64_t seq_id);
  /// Drops the last `n_tokens` tokens, releasing pages left empty.
  void truncate(int64_t seq_id, int64_t n_tokens);
  /// Releases pages wholly before the last `window` tokens; their block-table
  /// entries become the null page. Returns how many pages were released.
  int release_outside_window(int64_t seq_id, int64_t window);

  /// Pages `append(seq_id, n_tokens)` would take now: new pages plus one
  /// copy-on-write copy of a shared last page. INT_MAX when it can never fit.
  int pages_needed(int64_t seq_id, int64_t n_tokens) const;
  /// First token whose page is still held: tokens before it were released
  /// by `release_outside_window` (their entries are the null page).
  int64_t first_held_token(int64_t seq_id) const;

  bool has_sequence(int64_t seq_id) const;
  std::vector<int64_t> sequences() const;
  std::vector<int32_t> block_table(int64_t seq_id) const;
  int64_t length(int64_t seq_id) const;

  // -- pages ---------------------------------------------------------------
  /// Pages `append` can still hand out: free plus evictable cached (materialized pages only;
  /// add `num_unmaterialized_pages()` for what the capacity still allows).
  int num_free_pages() const;
  int num_cached_pages() const { return static_cast<int>(lru_.size()); }
  int num_used_pages() const;
  int refcount(int page) const;
  std::optional<uint64_t> page_hash(int page) const;
  /// Cached pages in eviction order (first evicted first).
  std::vector<int32_t> cached_pages() const;

  // -- prefix index --------------------------------------------------------
  /// Hashes the sequence's full pages covered by `token_ids` (its first
  /// tokens; only min(len, length) count) and indexes those not yet indexed.
  /// Returns how many pages were newly indexed.
  int register_full_pages(int64_t seq_id, const std::vector<int32_t>& token_ids);
  /// Pages of the longest indexed chain that prefixes `token_ids`. Pure: no
  /// counters, no refcounts, no LRU change.
  std::vector<int32_t> match_prefix(
      const std::vector<int32_t>& token_ids, const std::string& ns = "") const;
  /// For each of the first `max_pages` full pages of `token_ids`: the indexed
  /// page holding that page of the chain, or 0 where it is not indexed. Unlike
  /// `match_prefix` it does not stop at the first miss: a sliding-window
  /// group only needs the pages of its window. Pure.
  std::vector<int32_t> prefix_hits(
      const std::vector<int32_t>& token_ids, const std::string& ns,
      size_t max_pages) const;
  /// Adds a sequence of `n_pages` full pages of `token_ids` taken from the
  /// index: pages [first, n_pages) must all be indexed (see `prefix_hits`),
  /// pages [0, first) start released (null), as after a window release.
  /// Counts n_pages - first hits and max_pages - n_pages misses.
  void add_sequence_with_pages(
      int64_t seq_id, const std::vector<int32_t>& token_ids,
      const std::string& ns, int64_t n_pages, int64_t first, int64_t max_pages);
  /// Caps cached (refcount 0, hashed) pages; evicts LRU pages over the cap now.
  void set_cache_cap(int pages);
  int cache_cap() const { return cache_cap_; }

  int64_t hits() const { return hits_; }
  int64_t misses() const { return misses_; }
  int64_t evictions() const { return evictions_; }

  /// Debug check of every internal invariant; throws std::logic_error.
  void check() const;

 private:
  struct Sequence {
    std::vector<int32_t> pages;   // block table; 0 = released by a window
    int64_t length = 0;
    std::vector<uint64_t> hashes; // chain hash of each full page hashed so far
    int ns = 0;                   // interned namespace
    int64_t released_upto = 0;    // pages [0, released_upto) are null
  };
  struct PageKey {
    uint64_t hash = 0;
    uint64_t parent = 0;
    int ns = 0;
    std::vector<int32_t> tokens;  // kept to turn a hash collision into a miss
  };

  Sequence& seq(int64_t seq_id, const char* fn);
  const Sequence& seq(int64_t seq_id, const char* fn) const;
  void check_page(int page, const char* fn) const;
  int intern(const std::string& ns);
  std::optional<int> find_ns(const std::string& ns) const;

  int allocate();           // caller has checked capacity; refcount 1
  void release(int page);   // refcount--, moves to free queue or LRU at 0
  void evict_front();       // LRU front -> free queue
  void unhash(int page);
  void take_ref(int page);  // refcount++, pulling a cached page out of the LRU
  void enforce_cap();

  uint64_t root_hash(int ns) const;
  uint64_t chain_hash(uint64_t parent, const int32_t* tokens, int ns) const;
  // Pages matched by chain; stops at the first miss or after max_pages.
  std::vector<int32_t> match(
      const std::vector<int32_t>& token_ids, int ns, size_t max_pages,
      std::vector<uint64_t>* hashes) const;

  int page_size_;
  int materialized_ = 0;
  std::vector<int32_t> refcount_;
  std::deque<int32_t> free_;                  // refcount 0, unhashed
  std::list<int32_t> lru_;                    // refcount 0, hashed
  std::vector<std::list<int32_t>::iterator> where_;  // position in lru_
  std::vector<uint8_t> in_lru_;
  int used_ = 0;                              // pages with refcount > 0
  std::vector<std::optional<PageKey>> keys_;  // per page
  std::unordered_map<uint64_t, int32_t> index_;  // chain hash -> page
  std::unordered_map<int64_t, Sequence> seqs_;
  std::vector<std::string> namespaces_;
  std::vector<uint64_t> ns_hash_;
  int cache_cap_;
  int64_t hits_ = 0, misses_ = 0, evictions_ = 0;
};

/// The pools of a model whose layers differ in attention span (vLLM's hybrid
/// KV manager): one PagePool per *group* of layers sharing a sliding window
/// (or global), each with its own block tables, so a windowed group releases
/// the pages behind its window while the global group keeps every page.
///
///   Gemma 3: 5 windowed layers (window 512) per global layer, page_size 16,
///   slack 16, length 2000:
///
///     group 0 (global)       [ 3][ 8][ 1] ... [77][78]  125 pages, all held
///     group 1 (window 512)   [ 0][ 0][ 0] ... [ 5][ 9]   34 pages held, the
///                                                        rest back in the pool
///
/// A group with window w keeps the last `keep = w - 1 + slack` tokens (at
/// least 1): w - 1 is what the next query reads, and the slack lets a caller
/// roll back (truncate) up to `slack` tokens past the last append. Each
/// sequence exists in every group with the same length.
///
///   append   release each windowed group's pages behind `keep`, then all
///            groups or none: nullopt (nothing appended) when any group has
///            too few free pages
///   prefix   a hit of k pages needs every group to hit: the global group
///            pages [0, k), a windowed group only the ceil(keep / page_size)
///            pages before k (earlier ones start released); the longest k
///            every group allows wins
///   truncate refuses (std::invalid_argument, nothing changed) to end a
///            sequence where a windowed group's next query would read a
///            released token
///
/// Bad input throws std::invalid_argument; not thread-safe.
class PageGroups {
 public:
  /// `windows[g]`: the group's sliding window in tokens, 0 for global;
  /// `num_pages[g]`: its pool's capacity (null page included);
  /// `materialized[g]`: the pages it hands out at first (empty: all).
  PageGroups(const std::vector<int>& num_pages, int page_size,
             const std::vector<int64_t>& windows, int64_t slack,
             const std::vector<int>& materialized = {});

  int num_groups() const { return static_cast<int>(pools_.size()); }
  int page_size() const { return page_size_; }
  int64_t slack() const { return slack_; }
  PagePool& pool(int group);
  const PagePool& pool(int group) const;
  int64_t window(int group) const;
  /// Tokens behind the end a group keeps (0 = all, a global group).
  int64_t keep(int group) const;

  void add_sequence(int64_t seq_id, const std::string& ns = "");
  /// As PagePool::add_sequence_with_prefix, over every group (see above);
  /// returns the number of cached tokens.
  int64_t add_sequence_with_prefix(
      int64_t seq_id, const std::vector<int32_t>& token_ids,
      const std::string& ns = "");
  /// Tokens `add_sequence_with_prefix` would reuse now. Pure.
  int64_t match_prefix(
      const std::vector<int32_t>& token_ids, const std::string& ns = "") const;
  /// One AppendResult per group, or nullopt when some group is out of pages
  /// (nothing appended; window releases may have happened).
  std::optional<std::vector<AppendResult>> append(int64_t seq_id, int64_t n_tokens);
  /// Appends counts[i] tokens to seq_ids[i] for every i, all or nothing, and
  /// returns the step plan of the R = sum(counts) new tokens (see StepPlan);
  /// nullopt when some group is out of pages (no sequence grew; window
  /// releases may have happened). Ids must be distinct, counts >= 1. R is
  /// rounded up to a multiple of `row_bucket` with padding rows (position 0,
  /// length 1, null table, written at slot 0 of the null page).
  std::optional<StepPlan> append_batch(const std::vector<int64_t>& seq_ids,
                                       const std::vector<int64_t>& counts,
                                       int table_bucket = 1, int row_bucket = 1);
  void fork(int64_t src, int64_t dst);
  void free(int64_t seq_id);
  void truncate(int64_t seq_id, int64_t n_tokens);
  /// Indexes the sequence's held full pages in every group; returns the
  /// number of pages newly indexed, summed over groups.
  int register_full_pages(int64_t seq_id, const std::vector<int32_t>& token_ids);

  bool has_sequence(int64_t seq_id) const;
  std::vector<int64_t> sequences() const;
  int64_t length(int64_t seq_id) const;
  std::vector<int32_t> block_table(int64_t seq_id, int group) const;
  /// Pages of `group` the sequence holds (non-null block-table entries).
  int held_pages(int64_t seq_id, int group) const;

  /// Pages each group needs to append `counts[i]` tokens to `seq_ids[i]`
  /// for every i now (new pages plus copy-on-write copies; no window release,
  /// so ask after a failed append, which released). Pure.
  std::vector<int64_t> pages_needed(const std::vector<int64_t>& seq_ids,
                                    const std::vector<int64_t>& counts) const;
  /// PagePool::grow on one group.
  int grow(int group, int to);

  int64_t hits() const { return hits_; }
  int64_t misses() const { return misses_; }

  /// Debug check of every pool and of the groups agreeing on sequences and
  /// lengths; throws std::logic_error.
  void check() const;

 private:
  void check_group(int group, const char* fn) const;
  const PagePool& first(int64_t seq_id, const char* fn) const;
  // Largest k <= max_pages (pages) every group can start a sequence at.
  int64_t best_prefix(const std::vector<int32_t>& token_ids, const std::string& ns,
                      int64_t max_pages) const;
  int64_t first_page(int group, int64_t n_pages) const;

  int page_size_;
  int64_t slack_;
  std::vector<PagePool> pools_;
  std::vector<int64_t> windows_;
  std::vector<int64_t> keep_;
  int64_t hits_ = 0, misses_ = 0;
};

}  // namespace mlx_infer
