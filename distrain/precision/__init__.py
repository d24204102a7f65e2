"""Mixed precision: autocast compute dtype over fp32 weights, and the gradient scaler for fp16."""
