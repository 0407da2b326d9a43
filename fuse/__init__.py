"""fuse: a torch.compile fusion layer for the decode path of DeepSeek-V4-Flash-class models."""
