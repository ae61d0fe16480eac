"""What this machine has: GPU, VRAM (free and total), capability, host RAM and a pinned-memory budget.

``SystemInfo`` is plain data so plans can be computed for any machine (tests, ``--vram-gb``); ``detect_system``
reads the real one. CUDA is only touched inside ``detect_system``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

GiB = 1024 ** 3
# Pinned (page-locked) memory cannot be swapped out by the OS: keep at most this share of the host RAM pinned,
# and always leave this much RAM available to everything else.
PINNED_SHARE = 0.5
HOST_RAM_HEADROOM = 4 * GiB


def gib(n_bytes: float) -> str:
    """Bytes as a short GiB string: ``'6.04 GiB'``."""
    return f"{n_bytes / GiB:.2f} GiB"


class PlainFields:
    """``to_dict`` / ``from_dict`` of a plain-data dataclass; ``from_dict`` leaves out keys it has no field for."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def pinned_budget_for(total: int, available: int) -> int:
    """How many bytes may be pinned: half the RAM, and never eat into the last few GiB of available RAM."""
    return int(max(0, min(total * PINNED_SHARE, available - HOST_RAM_HEADROOM)))


@dataclass
class SystemInfo(PlainFields):
    device: str = "cpu"                 # 'cuda' or 'cpu'
    gpu_name: str = "none"
    total_vram: int = 0                 # bytes
    free_vram: int = 0                  # bytes, as cudaMemGetInfo reports (other processes included)
    capability: tuple | None = None     # (major, minor)
    bf16: bool = False
    fp8: bool = False                   # fp8 matmul hardware (SM 8.9+)
    host_ram_total: int = 0
    host_ram_available: int = 0
    pinned_budget: int = 0
    simulated: bool = False
    device_index: int = 0
    vram_cap: int = 0                   # bytes of WAN_ACCEL_VRAM_CAP_GB when it made the card look smaller (0: none)

    def __post_init__(self):
        if self.capability is not None:
            self.capability = tuple(int(c) for c in self.capability)

    @property
    def has_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def capability_str(self) -> str:
        return "none" if self.capability is None else f"{self.capability[0]}.{self.capability[1]}"

    def describe(self) -> str:
        ram = f"host RAM {gib(self.host_ram_available)} available of {gib(self.host_ram_total)}"
        if not self.has_gpu:
            return f"CPU only (no CUDA device); {ram}"
        sim = (" (simulated)" if self.simulated else "") + \
            (f" (capped to {gib(self.vram_cap)})" if self.vram_cap else "")
        return (f"{self.gpu_name}{sim}: {gib(self.free_vram)} free of {gib(self.total_vram)}, SM {self.capability_str}, "
                f"bf16 {'yes' if self.bf16 else 'no'}, fp8 {'yes' if self.fp8 else 'no'}; {ram}, "
                f"pinned budget {gib(self.pinned_budget)}")

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["capability"] = list(self.capability) if self.capability is not None else None
        return d

    @classmethod
    def simulated_gpu(cls, vram_gb: float, *, ram_gb: float | None = None, capability=(8, 9),
                      name: str = "simulated GPU", free_gb: float | None = None) -> "SystemInfo":
        """A GPU with ``vram_gb`` GiB (all free unless ``free_gb``); host RAM real unless ``ram_gb`` is given."""
        if vram_gb <= 0:
            raise ValueError(f"vram_gb must be positive, got {vram_gb}")
        total_ram, avail_ram = (int(ram_gb * GiB),) * 2 if ram_gb is not None else host_memory()
        cap = tuple(capability)
        total, free, capped_to = capped_card(int(vram_gb * GiB), int((vram_gb if free_gb is None else free_gb) * GiB))
        return cls(device="cuda", gpu_name=name, total_vram=total, free_vram=free, capability=cap,
                   bf16=cap >= (8, 0), fp8=cap >= (8, 9), host_ram_total=total_ram, host_ram_available=avail_ram,
                   pinned_budget=pinned_budget_for(total_ram, avail_ram), simulated=True, vram_cap=capped_to)


MEMORY_LIMIT_ENV = "WAN_ACCEL_MEMORY_LIMIT_GB"


def memory_limit() -> int | None:
    """The most memory (bytes) a run may count on, from ``WAN_ACCEL_MEMORY_LIMIT_GB`` (GiB, a positive number):
    caps the available host RAM and the free VRAM every estimate and plan uses, to keep memory for other programs.
    None when unset; ValueError naming the variable when it is not a positive number."""
    return _gib_env(MEMORY_LIMIT_ENV, 24, "use all the memory there is")


def parse_gib(raw, name: str, example: int, unset_means: str) -> int:
    """Bytes of ``raw``, a positive finite number of GiB (text or a number); ValueError naming ``name``, an
    example and what unsetting it means otherwise ('abc', 0, -1, nan, inf). The one parser of the memory
    variables and of a cap given in code."""
    try:
        value = float(raw) if not isinstance(raw, bool) else float("nan")
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a positive number of GiB (e.g. {example}), got {str(raw).strip()!r}; "
                         f"unset it to {unset_means}")
    return int(value * GiB)


def _gib_env(name: str, example: int, unset_means: str) -> int | None:
    """Bytes from the environment variable ``name`` holding a positive number of GiB (``parse_gib``); None when
    unset."""
    raw = os.environ.get(name, "").strip()
    return parse_gib(raw, name, example, unset_means) if raw else None


VRAM_CAP_ENV = "WAN_ACCEL_VRAM_CAP_GB"


def vram_cap() -> int | None:
    """The card size (bytes) to plan for, from ``WAN_ACCEL_VRAM_CAP_GB`` (GiB, a positive number): a big GPU made to
    behave like a smaller card. ``detect_system`` then reports this as the card's total and at most this less what
    this process holds as free, and a simulated card (``SystemInfo.simulated_gpu``, ``plan --vram-gb``) is capped
    the same way, so every face's VRAM plan (nodes, command line, benches) decides block swap, KV window and VAE
    chunks for that card; ``apply_vram_cap`` also caps the CUDA caching allocator to it. None when unset;
    ValueError naming the variable when it is not a positive number, on every device (``detect_system`` reads it
    first, with or without a GPU)."""
    return _gib_env(VRAM_CAP_ENV, 12, "plan for the whole card")


def capped_card(total: int, free: int, held: int = 0) -> tuple:
    """(total, free, the cap in bytes or 0) of a card of ``total`` bytes with ``free`` free, as a plan sees it
    under ``WAN_ACCEL_VRAM_CAP_GB`` (a cap at or above the card changes nothing; ``held``: what this process
    already holds of the cap)."""
    cap = vram_cap()
    if cap is None or cap >= total:
        return int(total), int(free), 0
    return cap, min(int(free), max(0, cap - int(held))), cap


def apply_vram_cap(cap_gb: float | None = None, device=None) -> dict:
    """Make this process's CUDA memory behave like a card of ``cap_gb`` GiB (default: ``WAN_ACCEL_VRAM_CAP_GB``):
    sets ``WAN_ACCEL_VRAM_CAP_GB`` (so the VRAM plan sees that card) and the caching allocator's per-process
    fraction cap / total, so any allocation past the cap raises out of memory as on the smaller card. Call it before
    anything is allocated on the device. Returns {'cap_bytes', 'total_bytes', 'fraction'}; ValueError when the cap
    is not a positive number, there is no CUDA device or the cap exceeds the card; a refused cap changes nothing
    (the variable is set only once the allocator is capped)."""
    import torch  # lazy

    if cap_gb is not None:
        cap = parse_gib(cap_gb, "the memory cap", 12, "run without a cap")
    else:
        cap = vram_cap()
        if cap is None:
            raise ValueError(f"no memory cap given ({VRAM_CAP_ENV} is unset)")
    if not torch.cuda.is_available():
        raise ValueError(f"a memory cap of {cap / GiB:g} GiB caps CUDA memory, and there is no CUDA device")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = int(torch.cuda.get_device_properties(index).total_memory)
    if cap > total:
        raise ValueError(f"a memory cap of {cap / GiB:g} GiB is more than the card's {total / GiB:.1f} GiB")
    fraction = cap / total
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    if cap_gb is not None:
        os.environ[VRAM_CAP_ENV] = f"{float(cap_gb):g}"
    return {"cap_bytes": int(cap), "total_bytes": total, "fraction": fraction}


def _capped(n_bytes: int) -> int:
    limit = memory_limit()
    return int(n_bytes) if limit is None else min(int(n_bytes), limit)


def _cgroup_limit() -> int | None:
    """The container memory limit (cgroup v2 or v1), when one is set."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as fh:
                raw = fh.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < (1 << 60):
            return int(raw)
    return None


def host_memory() -> tuple[int, int]:
    """(total, available) host RAM in bytes from /proc/meminfo, else os.sysconf; capped by a cgroup limit, and the
    available RAM by ``WAN_ACCEL_MEMORY_LIMIT_GB`` (``memory_limit``)."""
    total = avail = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            info = {}
            for line in fh:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    info[name] = int(parts[0]) * 1024  # kB
        total = info.get("MemTotal", 0)
        avail = info.get("MemAvailable", info.get("MemFree", 0))
    except OSError:
        pass
    if not total:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            total = os.sysconf("SC_PHYS_PAGES") * page
            avail = os.sysconf("SC_AVPHYS_PAGES") * page
        except (ValueError, OSError, AttributeError):
            total = avail = 0
    limit = _cgroup_limit()
    if limit is not None and total:
        total = min(total, limit)
        avail = min(avail, limit)
    return int(total), _capped(avail)


def detect_system(device=None) -> SystemInfo:
    """Read this machine. ``device``: a CUDA index / 'cuda:N' / torch.device, or None for the current one."""
    import torch  # lazy

    vram_cap()                          # WAN_ACCEL_VRAM_CAP_GB checked on every device, where it is read
    total_ram, avail_ram = host_memory()        # WAN_ACCEL_MEMORY_LIMIT_GB, likewise
    if not torch.cuda.is_available() or (device is not None and str(device).startswith("cpu")):
        return SystemInfo(host_ram_total=total_ram, host_ram_available=avail_ram, pinned_budget=0)
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    # The driver counts memory that this process's caching allocator holds but does not use as taken; it is
    # free for our next allocations, so add it back.
    free += max(0, torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index))
    total, free, capped_to = capped_card(total, free, torch.cuda.memory_allocated(index))   # plan for the cap
    free = _capped(free)                # WAN_ACCEL_MEMORY_LIMIT_GB: memory kept for other programs
    cap = (int(props.major), int(props.minor))
    bf16 = cap >= (8, 0)  # native bf16 (Ampere and newer) on this device, not emulation
    return SystemInfo(device="cuda", gpu_name=str(props.name), total_vram=int(total), free_vram=int(free),
                      capability=cap, bf16=bf16, fp8=cap >= (8, 9), host_ram_total=total_ram,
                      host_ram_available=avail_ram, pinned_budget=pinned_budget_for(total_ram, avail_ram),
                      device_index=int(index), vram_cap=int(capped_to))


def auto_dtype(system: SystemInfo) -> tuple[str, str]:
    """('bf16' | 'fp16' | 'fp32', reason) for a model loaded with dtype 'auto' on ``system``: bf16 where the GPU has
    bf16 tensor cores (SM 8.0+), fp16 on older GPUs (SM 7.5 runs bf16 matmuls emulated, several times slower),
    fp32 on the CPU. The VRAM plan makes the same choice (``plan._choose_dtype``)."""
    if not system.has_gpu:
        return "fp32", "no CUDA device: the CPU computes in float32"
    if system.bf16:
        return "bf16", f"SM {system.capability_str} has bf16 tensor cores"
    return "fp16", (f"SM {system.capability_str} has no bf16 tensor cores (bf16 would be emulated): float16; "
                    "bf16-trained weights may lose a little precision")
