"""SageMaker: the plan (a training-job spec), its hyperparameters, AWS credentials, and the job handle."""
