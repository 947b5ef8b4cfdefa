from feeder import Feeder, ImageFolder, TarShards, ops
src = ImageFolder("/tmp/rv/train")
def t(name, fn):
    try: r = fn(); print(name, "ACCEPTED", r)
    except Exception as e: print(name, type(e).__name__, str(e)[:220])
T = [ops.Resize((8, 8))]
t("shards on folder", lambda: Feeder(src, 4, T, shuffle="shards"))
t("shuffle_shards w/o shards", lambda: Feeder(TarShards("/tmp/rv/shards/train.json"), 4, T, shuffle=True, shuffle_shards=2))
t("shuffle_shards=0", lambda: Feeder(TarShards("/tmp/rv/shards/train.json"), 4, T, shuffle="shards", shuffle_shards=0))
t("shuffle_shards huge", lambda: len(Feeder(TarShards("/tmp/rv/shards/train.json"), 4, T, shuffle="shards", shuffle_shards=10**6)))
t("shuffle_window w/o shards", lambda: Feeder(src, 4, T, shuffle=True, shuffle_window=10))
t("shuffle False + shuffle_shards", lambda: Feeder(TarShards("/tmp/rv/shards/train.json"), 4, T, shuffle=False, shuffle_shards=2))
t("shuffle='true'", lambda: Feeder(src, 4, T, shuffle="true"))
t("shuffle=1", lambda: Feeder(src, 4, T, shuffle=1))
t("lazy_index='yes'", lambda: TarShards("/tmp/rv/shards/train.json", lazy_index="yes"))
t("index_cache=0", lambda: TarShards("/tmp/rv/shards/train.json", lazy_index=True, index_cache=0))
t("rank w/o world", lambda: Feeder(src, 4, T, rank=1))
t("world w/o rank", lambda: Feeder(src, 4, T, world_size=2))
t("rank=2 world=2", lambda: Feeder(src, 4, T, rank=2, world_size=2))
