"""`suite pretrain` as a training method: the prepared token shards and, with model.init_from, the
weights it starts from (suite.pretrain.method). The loop is suite.train.trainer's."""
