# Sourced by run_h200.sh and bisect_w8a8_prefill.sh: run another commit's tree (a worktree, carried)
# beside this one. An older tree is not installable as is (it predates the relative imports), so
# its package layout is rebuilt: conveyor/ copied, its subpackages and benchmarks linked to the
# tree. Then `cd PKG && PYTHONPATH=PKG:/tmp/site python3 -m benchmarks....` runs that tree's code.
#
#   tree_package TREE PKG    # TREE: the worktree's directory; PKG: the layout to (re)build
tree_package() {
  local tree pkg=$2 d
  tree=$(cd "$1" && pwd) || return 1
  rm -rf "$pkg" && mkdir -p "$pkg/conveyor" && cp -r "$tree"/conveyor/* "$pkg/conveyor/"
  for d in engine kernels protocol services; do ln -sfn "$tree/$d" "$pkg/conveyor/$d"; done
  ln -sfn "$tree/benchmarks" "$pkg/benchmarks"
}
